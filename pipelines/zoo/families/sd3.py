"""Stable Diffusion 3.5 Large: 38 MMDiT blocks, 38 heads x 64 = 2432 wide, QK RMS norm; text is
CLIP-L + CLIP-G (77 tokens, padded to 4096) followed by 256 T5-XXL tokens."""

from __future__ import annotations

from typing import Any

from ..spec import Family
from .common import GEOMETRY, SD3_VAE, TINY_TEXT, TINY_TEXT_LEN, e, text_pair

__all__ = ["FAMILY"]

_FULL: dict[str, Any] = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
    dual_attention_layers=(),
    qk_norm="rms_norm",
)
_TINY = {
    **_FULL,
    "sample_size": 8,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": TINY_TEXT,
    "caption_projection_dim": 32,
    "pooled_projection_dim": TINY_TEXT,
    "pos_embed_max_size": 16,
}
_POOLED = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")

FAMILY = Family(
    name="sd3",
    pipeline="StableDiffusion3Pipeline",
    released="stabilityai/stable-diffusion-3.5-large",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=SD3_VAE,
    scheduler=dict(num_train_timesteps=1000, shift=3.0),
    geometry=GEOMETRY,
    embeddings={
        "full": {**text_pair(77 + 256, 4096), **{k: e(1, 2048) for k in _POOLED}},
        "tiny": {**text_pair(TINY_TEXT_LEN, TINY_TEXT), **{k: e(1, TINY_TEXT) for k in _POOLED}},
    },
    steps=28,
    guidance={"guidance_scale": 3.5},
    cfg=True,
)
