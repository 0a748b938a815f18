"""PixArt-Sigma XL/2 at 1024px: 28 blocks, 16 heads x 72 = 1152 wide, T5-XXL text (300 tokens), a
learned variance (8 = 2 x 4 output channels), the SDXL autoencoder."""

from __future__ import annotations

from typing import Any

from ..spec import Family
from .common import BINNED_T5_EXTRAS, DPM_SOLVER, GEOMETRY, SDXL_VAE, TINY_TEXT, TINY_TEXT_LEN, text_pair

__all__ = ["FAMILY"]

_FULL: dict[str, Any] = dict(
    num_attention_heads=16,
    attention_head_dim=72,
    in_channels=4,
    out_channels=8,
    num_layers=28,
    cross_attention_dim=1152,
    attention_bias=True,
    sample_size=128,
    patch_size=2,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_single",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    interpolation_scale=2,
    use_additional_conditions=False,
    caption_channels=4096,
)
_TINY = {
    **_FULL,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "cross_attention_dim": 32,
    "sample_size": 8,
    "interpolation_scale": 1,
    "caption_channels": TINY_TEXT,
}

FAMILY = Family(
    name="pixart-sigma",
    pipeline="PixArtSigmaPipeline",
    released="PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
    scheduler_class="DPMSolverMultistepScheduler",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=SDXL_VAE,
    scheduler={**DPM_SOLVER, "prediction_type": "epsilon"},
    geometry=GEOMETRY,
    embeddings={
        "full": text_pair(300, 4096, "mask_int"),
        "tiny": text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
    },
    extras=BINNED_T5_EXTRAS,
    steps=20,
    guidance={"guidance_scale": 4.5},
    cfg=True,
)
