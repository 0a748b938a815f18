"""Chroma1-HD: FLUX.1-schnell's 19 + 38 blocks with the modulation computed by one small network
(the "approximator") instead of per block, T5-XXL text only (512 tokens)."""

from __future__ import annotations

from diffusers import ChromaTransformer2DModel

from ...construction import init_defaults
from ..spec import Family
from .common import FLUX_SCHEDULER, FLUX_VAE, GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, text_length, text_pair

__all__ = ["FAMILY"]

_FULL = init_defaults(ChromaTransformer2DModel)
_TINY = {
    **_FULL,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
    "num_attention_heads": 2,
    "joint_attention_dim": TINY_TEXT,
    "axes_dims_rope": (4, 6, 6),
    "approximator_num_channels": 16,
    "approximator_hidden_dim": 32,
    "approximator_layers": 1,
}

FAMILY = Family(
    name="chroma",
    pipeline="ChromaPipeline",
    released="lodestones/Chroma1-HD",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=FLUX_VAE,
    scheduler=FLUX_SCHEDULER,
    geometry=GEOMETRY,
    # The pipeline's own T5 step hands the mask on in the embeddings' dtype.
    embeddings={
        "full": text_pair(512, 4096, "mask_float"),
        "tiny": text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_float"),
    },
    extras=text_length(512),
    steps=40,
    guidance={"guidance_scale": 5.0},
    cfg=True,
)
