"""Qwen-Image 2.1 built offline with random weights, tiny or at its released size.

The text encoder's special token ids are the offline tokenizer's (as :mod:`pipelines.releases`
gives every built-in model's), and the pipeline reads the prompt through the offline Qwen3-VL
processor (:mod:`pipelines.vl_processor`) instead of a bare tokenizer.
"""

from __future__ import annotations

import torch
from diffusers import QwenImage21Pipeline

from .construction import as_dtype, seeded
from .releases.qwen_image_21 import PROCESSOR_IMAGES, QWEN_IMAGE_21
from .tokenizer import build_tokenizer, special_token_ids
from .vl_processor import build_processor

__all__ = ["build_qwen_image_21", "text_encoder_config"]


def text_encoder_config(size: str) -> object:
    """The Qwen3-VL config at ``size`` with the offline tokenizer's special ids (and, tiny, its
    vocabulary rounded up to a multiple of 64)."""
    part = QWEN_IMAGE_21.text_encoders["text_encoder"]
    kwargs = part.config(size)
    tok = build_tokenizer()
    ids = special_token_ids(tok)
    text = kwargs["text_config"]
    if size == "tiny":
        text["vocab_size"] = (len(tok) + 63) // 64 * 64
    text.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    kwargs.update(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    assert part.config_class is not None
    return part.config_class(**kwargs)


def build_qwen_image_21(
    size: str = "tiny", device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32, seed: int = 0
) -> QwenImage21Pipeline:
    """``QwenImage21Pipeline`` with seeded random weights at ``size`` ("tiny" or "full"), in eval
    mode on ``device`` in ``dtype``."""
    if size not in PROCESSOR_IMAGES:
        raise ValueError(f"unknown size {size!r}: expected 'tiny' or 'full'")
    dtype = as_dtype(dtype)
    r = QWEN_IMAGE_21
    config = text_encoder_config(size)
    transformer = seeded(lambda: r.transformer.cls(**r.transformer.config(size)), device, dtype, seed)
    vae = seeded(lambda: r.vae.cls(**r.vae.config(size)), device, dtype, seed)
    text_encoder = seeded(lambda: r.text_encoders["text_encoder"].cls(config), device, dtype, seed)
    pipe = QwenImage21Pipeline(
        scheduler=r.scheduler_class(**r.scheduler),
        vae=vae,
        text_encoder=text_encoder,
        processor=build_processor(build_tokenizer(), PROCESSOR_IMAGES[size]),
        transformer=transformer,
    )
    return pipe.to(device)
