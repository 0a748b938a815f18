"""Qwen-Image-Edit: Qwen-Image's 20B transformer and VAE; the text is Qwen2.5-VL-7B reading the
prompt and the input image together (the image's vision tokens make the text long). The pipeline
cuts the embeddings to the prompt's own length: one prompt's mask is all ones."""

from __future__ import annotations

from ...releases.configs import scheduler_config, transformer_config, vae_config
from ..spec import Embedding, Family
from .common import GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, e, mask

__all__ = ["FAMILY"]


def _streams(length: int, width: int) -> dict[str, Embedding]:
    return {
        "prompt_embeds": e(1, length, width),
        "prompt_embeds_mask": mask(length, "mask_ones"),
        "negative_prompt_embeds": e(1, length, width),
        "negative_prompt_embeds_mask": mask(length, "mask_ones"),
    }


FAMILY = Family(
    name="qwen-image-edit",
    pipeline="QwenImageEditPipeline",
    released="Qwen/Qwen-Image-Edit",
    denoiser_configs={s: transformer_config("qwen-image", s) for s in ("tiny", "full")},
    vae_configs={s: vae_config("qwen-image", s) for s in ("tiny", "full")},
    scheduler=scheduler_config("qwen-image"),
    geometry=GEOMETRY,
    embeddings={"full": _streams(1400, 3584), "tiny": _streams(TINY_TEXT_LEN, TINY_TEXT)},
    steps=50,
    guidance={"true_cfg_scale": 4.0},
    cfg=True,
    image="image",
)
