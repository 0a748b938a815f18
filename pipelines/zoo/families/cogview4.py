"""CogView4-6B: 28 blocks, 32 heads x 128 = 4096 wide, GLM-4-9B text (4096 wide; the prompt padded
to a multiple of 16, so a short negative prompt is 16 tokens)."""

from __future__ import annotations

from typing import Any

from ..spec import Family
from .common import GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, e

__all__ = ["FAMILY"]

_FULL: dict[str, Any] = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=28,
    attention_head_dim=128,
    num_attention_heads=32,
    text_embed_dim=4096,
    time_embed_dim=512,
    condition_dim=256,
    pos_embed_max_size=128,
    sample_size=128,
    rope_axes_dim=(256, 256),
)
_TINY = {
    **_FULL,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "text_embed_dim": TINY_TEXT,
    "time_embed_dim": 16,
    "condition_dim": 8,
    "pos_embed_max_size": 16,
    "sample_size": 8,
    "rope_axes_dim": (16, 16),
}
_VAE_FULL: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 512, 1024, 1024],
    layers_per_block=3,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.0,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
_VAE_TINY = {**_VAE_FULL, "block_out_channels": [16, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8}

FAMILY = Family(
    name="cogview4",
    pipeline="CogView4Pipeline",
    released="THUDM/CogView4-6B",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler=dict(base_shift=0.25, max_shift=0.75, use_dynamic_shifting=True, time_shift_type="linear"),
    geometry=GEOMETRY,
    embeddings={
        "full": {"prompt_embeds": e(1, 128, 4096), "negative_prompt_embeds": e(1, 16, 4096)},
        "tiny": {"prompt_embeds": e(1, TINY_TEXT_LEN, TINY_TEXT), "negative_prompt_embeds": e(1, 16, TINY_TEXT)},
    },
    steps=50,
    guidance={"guidance_scale": 5.0},
    cfg=True,
)
