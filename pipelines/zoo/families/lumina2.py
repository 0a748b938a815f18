"""Lumina-Image-2.0: 26 blocks + 2 + 2 refiners, 24 heads (8 KV) x 96 = 2304 wide, Gemma-2-2B text
(2304 wide, 256 tokens). diffusers' defaults but for the text width."""

from __future__ import annotations

from diffusers import Lumina2Transformer2DModel

from ...construction import init_defaults
from ..spec import Family
from .common import FLUX_VAE, GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, text_length, text_pair

__all__ = ["FAMILY"]

_FULL = {**init_defaults(Lumina2Transformer2DModel), "cap_feat_dim": 2304}
_TINY = {
    **_FULL,
    "sample_size": 8,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "multiple_of": 16,
    "axes_dim_rope": (4, 6, 6),  # must sum to the head dim (32 / 2)
    "axes_lens": (64, 64, 64),
    "cap_feat_dim": TINY_TEXT,
}

FAMILY = Family(
    name="lumina2",
    pipeline="Lumina2Pipeline",
    released="Alpha-VLLM/Lumina-Image-2.0",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=FLUX_VAE,
    scheduler=dict(num_train_timesteps=1000, shift=6.0),
    geometry=GEOMETRY,
    embeddings={
        "full": text_pair(256, 2304, "mask_int"),
        "tiny": text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
    },
    extras=text_length(256),
    steps=30,
    guidance={"guidance_scale": 4.0},
    cfg=True,
)
