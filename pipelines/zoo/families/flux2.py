"""FLUX.2-dev: 8 double-stream and 48 single-stream blocks, 48 heads x 128 = 6144 wide, the text
three Mistral-Small-3.1 hidden layers stacked (3 x 5120 = 15360). diffusers' defaults."""

from __future__ import annotations

from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

from ...construction import init_defaults
from ...releases.configs import scheduler_config
from ..spec import Family
from .common import GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, e, text_length

__all__ = ["FAMILY"]

_FULL = init_defaults(Flux2Transformer2DModel)
_TINY = {
    **_FULL,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
    "num_attention_heads": 2,
    "joint_attention_dim": 3 * TINY_TEXT,
    "timestep_guidance_channels": 32,
    "axes_dims_rope": (4, 4, 4, 4),
}
_VAE_FULL = init_defaults(AutoencoderKLFlux2)  # 32 latent channels, 2x2 patchified
_VAE_TINY = {**_VAE_FULL, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 8}

FAMILY = Family(
    name="flux2",
    pipeline="Flux2Pipeline",
    released="black-forest-labs/FLUX.2-dev",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler=scheduler_config("flux2-klein"),  # FLUX.2's own, as the klein release has it
    geometry=GEOMETRY,
    embeddings={
        "full": {"prompt_embeds": e(1, 512, 15360)},
        "tiny": {"prompt_embeds": e(1, TINY_TEXT_LEN, 3 * TINY_TEXT)},
    },
    extras=text_length(512),
    steps=50,
    guidance={"guidance_scale": 4.0},  # distilled guidance
    cfg=False,
)
