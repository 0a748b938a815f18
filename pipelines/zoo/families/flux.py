"""FLUX.1-dev, the built-in model's denoiser, VAE and scheduler (:mod:`pipelines.families.flux.release`)."""

from __future__ import annotations

from ...releases.configs import transformer_config
from ..spec import Family
from .common import FLUX_SCHEDULER, FLUX_VAE, GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, e, text_length

__all__ = ["FAMILY"]

FAMILY = Family(
    name="flux",
    pipeline="FluxPipeline",
    released="black-forest-labs/FLUX.1-dev",
    denoiser_configs={s: transformer_config("flux", s) for s in ("tiny", "full")},
    vae_configs=FLUX_VAE,
    scheduler=FLUX_SCHEDULER,
    geometry=GEOMETRY,
    embeddings={
        "full": {"prompt_embeds": e(1, 512, 4096), "pooled_prompt_embeds": e(1, 768)},
        "tiny": {"prompt_embeds": e(1, TINY_TEXT_LEN, TINY_TEXT), "pooled_prompt_embeds": e(1, TINY_TEXT)},
    },
    extras=text_length(512),
    steps=28,
    guidance={"guidance_scale": 3.5},  # distilled guidance: an input of one call, not two branches
    cfg=False,
)
