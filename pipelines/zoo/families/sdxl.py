"""SDXL base 1.0: three levels (320, 640, 1280), 1 / 2 / 10 transformer layers per block, the two
CLIP text encoders concatenated (768 + 1280 = 2048), CLIP-G's pooled output and six size/crop
numbers as added conditions (1280 + 6 x 256 = 2816)."""

from __future__ import annotations

from typing import Any

from ..spec import Family
from .common import GEOMETRY, SDXL_VAE, TINY_TEXT, e, text_pair

__all__ = ["FAMILY"]

_FULL: dict[str, Any] = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    block_out_channels=[320, 640, 1280],
    layers_per_block=2,
    attention_head_dim=[5, 10, 20],
    cross_attention_dim=2048,
    transformer_layers_per_block=[1, 2, 10],
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    norm_num_groups=32,
)
_TINY = {
    **_FULL,
    "sample_size": 8,
    "block_out_channels": [32, 32, 64],
    "layers_per_block": 1,
    "attention_head_dim": [2, 2, 4],
    "cross_attention_dim": 2 * TINY_TEXT,
    "transformer_layers_per_block": [1, 1, 2],
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": TINY_TEXT + 6 * 8,
    "norm_num_groups": 8,
}
_POOLED = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")

FAMILY = Family(
    name="sdxl",
    pipeline="StableDiffusionXLPipeline",
    released="stabilityai/stable-diffusion-xl-base-1.0",
    scheduler_class="EulerDiscreteScheduler",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=SDXL_VAE,
    scheduler=dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    ),
    geometry=GEOMETRY,
    embeddings={
        "full": {**text_pair(77, 2048), **{k: e(1, 1280) for k in _POOLED}},
        "tiny": {**text_pair(77, 2 * TINY_TEXT), **{k: e(1, TINY_TEXT) for k in _POOLED}},
    },
    steps=50,
    guidance={"guidance_scale": 5.0},
    cfg=True,
    # No invisible watermark: it needs a package of its own and changes only decoded images.
    pipeline_kwargs={"add_watermarker": False},
)
