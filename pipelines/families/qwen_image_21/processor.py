"""An offline Qwen3-VL processor for the random-weight Qwen-Image 2.1 pipelines.

QwenImage21Pipeline reads its prompt and condition images through a ``Qwen3VLProcessor``: the
chat template (to count the system tokens it drops), the tokenizer and the image processor. The
released processor cannot be downloaded here, so it is put together from the offline Qwen
tokenizer (:mod:`pipelines.tokenizer`), a Qwen3-VL chat template for the messages the pipeline
renders, and transformers' Qwen2-VL image processor at Qwen3-VL's settings.

Its one difference from the released class: no video processor. transformers 5's
``Qwen3VLProcessor`` checks its video processor's class, which needs torchvision even when it is
None, and the pipeline never passes videos. :class:`TextImageProcessor` is the same processor
without that modality; text and images go through ``Qwen3VLProcessor``'s own code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase, Qwen2VLImageProcessorPil, Qwen3VLProcessor

__all__ = ["QWEN3_VL_CHAT_TEMPLATE", "QWEN3_VL_IMAGES", "TextImageProcessor", "build_processor"]

# Qwen3-VL's chat template for what QwenImage21Pipeline renders (a system message of text parts;
# images as the vision placeholder): the same text as the released template for these messages.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3-VL's preprocessor_config.json: 16-pixel patches merged 2x2 (one vision token per 32x32
# pixels, the 2x2 latent tokens of a 16x VAE), normalised to [-1, 1], bicubic resize, 256^2 to
# 4096^2 pixels per image.
QWEN3_VL_IMAGES: dict[str, Any] = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    resample=3,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)


class TextImageProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` for text and images only (see the module docstring)."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def build_processor(tokenizer: PreTrainedTokenizerBase, images: Mapping[str, Any] | None = None) -> TextImageProcessor:
    """The offline processor over ``tokenizer`` (shared, not mutated), its image processor at
    Qwen3-VL's settings updated with ``images`` (a tiny model's smaller minimum size)."""
    image_processor = Qwen2VLImageProcessorPil(**{**QWEN3_VL_IMAGES, **(images or {})})
    return TextImageProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE
    )
