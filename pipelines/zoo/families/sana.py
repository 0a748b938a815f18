"""Sana 1600M at 1024px: 20 linear-attention blocks, 70 heads x 32 = 2240 wide, Gemma-2-2B text
(2304 wide, 300 tokens), the 32x deep-compression autoencoder (32 latent channels)."""

from __future__ import annotations

from typing import Any

from diffusers import SanaTransformer2DModel

from ...construction import init_defaults
from ..spec import Family
from .common import BINNED_T5_EXTRAS, DPM_SOLVER, GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, text_pair

__all__ = ["FAMILY"]

_FULL = init_defaults(SanaTransformer2DModel)
_TINY = {
    **_FULL,
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "num_cross_attention_heads": 2,
    "cross_attention_head_dim": 16,
    "cross_attention_dim": 32,
    "caption_channels": TINY_TEXT,
    "sample_size": 2,
}
_VAE_FULL: dict[str, Any] = dict(
    in_channels=3,
    latent_channels=32,
    attention_head_dim=32,
    encoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    decoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
    decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
    encoder_layers_per_block=[2, 2, 2, 3, 3, 3],
    decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
    encoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
    decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
    upsample_block_type="interpolate",
    downsample_block_type="Conv",
    decoder_norm_types=["batch_norm"] * 3 + ["rms_norm"] * 3,
    decoder_act_fns=["relu"] * 3 + ["silu"] * 3,
    scaling_factor=0.41407,
)
_VAE_TINY = {
    **_VAE_FULL,
    "latent_channels": 8,
    "attention_head_dim": 8,
    "encoder_block_out_channels": [8, 8, 16, 16, 16, 16],
    "decoder_block_out_channels": [8, 8, 16, 16, 16, 16],
    "encoder_layers_per_block": [1] * 6,
    "decoder_layers_per_block": [1] * 6,
}

FAMILY = Family(
    name="sana",
    pipeline="SanaPipeline",
    released="Efficient-Large-Model/Sana_1600M_1024px_diffusers",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler={
        **DPM_SOLVER,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "flow_shift": 3.0,
        "final_sigmas_type": "zero",
    },
    geometry=GEOMETRY,
    embeddings={
        "full": text_pair(300, 2304, "mask_int"),
        "tiny": text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
    },
    extras=BINNED_T5_EXTRAS,
    steps=20,
    guidance={"guidance_scale": 4.5},
    cfg=True,
)
