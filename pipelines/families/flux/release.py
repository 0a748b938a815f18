"""FLUX.1-dev (black-forest-labs/FLUX.1-dev): a 12B double- and single-stream DiT with CLIP-L and
T5-XXL text encoders; its VAE is also Z-Image's."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from ...releases.encoders import CLIP_L_TEXT, T5_V1_1_XXL, TINY_CLIP_TEXT, TINY_T5
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release

__all__ = ["FLUX_1_DEV", "RELEASES", "SCHEDULER", "TRANSFORMER", "VAE"]

# transformer/config.json: 19 double-stream and 38 single-stream blocks, 24 heads x 128 = 3072
# wide, packed 2x2 latent patches (64 = 16 x 4 input channels), T5-XXL text (4096) and pooled
# CLIP-L (768) conditioning, and the distilled guidance embedding (FLUX.1-schnell has none).
_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TRANSFORMER = Part(
    FluxTransformer2DModel,
    {
        "full": _TRANSFORMER,
        "tiny": {
            **_TRANSFORMER,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
            "num_attention_heads": 2,
            "joint_attention_dim": TINY_TEXT_HIDDEN,
            "pooled_projection_dim": TINY_TEXT_HIDDEN,
            "axes_dims_rope": (4, 6, 6),
        },
    },
)

# vae/config.json, which Z-Image ships too: 4 blocks (scale factor 8), 16 latent channels, no
# quant convs.
_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
VAE = Part(
    AutoencoderKL,
    {
        "full": _VAE,
        "tiny": {
            **_VAE,
            "block_out_channels": [16, 16, 32, 32],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "sample_size": 128,
        },
    },
)

# scheduler/scheduler_config.json beyond diffusers' defaults (the rest of the file is them): the
# shift grows with the image's token count.
SCHEDULER: dict[str, Any] = dict(shift=3.0, use_dynamic_shifting=True)

FLUX_1_DEV = Release(
    name="flux",
    transformer=TRANSFORMER,
    vae=VAE,
    text_encoders={
        # FluxPipeline reads only CLIP's pooled output; T5's sequence is the text the blocks attend to.
        "text_encoder": Part(
            CLIPTextModel,
            {"full": CLIP_L_TEXT, "tiny": {**CLIP_L_TEXT, **TINY_CLIP_TEXT}},
            config_class=CLIPTextConfig,
            tokenizer="clip",
        ),
        "text_encoder_2": Part(
            T5EncoderModel,
            {"full": T5_V1_1_XXL, "tiny": {**T5_V1_1_XXL, **TINY_T5}},
            config_class=T5Config,
            tokenizer="t5",
        ),
    },
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=SCHEDULER,
)

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (FLUX_1_DEV,)
