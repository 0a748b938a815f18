"""Z-Image: a 6B single-stream DiT with a Qwen3-4B text encoder and the FLUX.1 VAE."""

from __future__ import annotations

from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model, Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

from ...construction import init_defaults
from ...releases.encoders import QWEN3_4B
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release
from ..flux import release as flux1

__all__ = ["RELEASES", "Z_IMAGE", "Z_IMAGE_OMNI"]

# diffusers' defaults are the release: dim 3840, 30 layers + 2 refiner layers, 30 heads x 128,
# cap_feat_dim 2560 (= Qwen3-4B's width).
_TRANSFORMER = init_defaults(ZImageTransformer2DModel)

# Qwen3-4B (pipelines.releases.encoders). The tiny one is written whole: it keeps Qwen3Config's own
# defaults (untied embeddings, its RoPE base) where the release sets them.
_TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=TINY_TEXT_HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,  # ZImagePipeline reads hidden_states[-2], so at least two layers
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=1024,
)

Z_IMAGE = Release(
    name="z-image",
    transformer=Part(
        ZImageTransformer2DModel,
        {
            "full": _TRANSFORMER,
            "tiny": {
                **_TRANSFORMER,
                "dim": 64,
                "n_layers": 2,
                "n_refiner_layers": 1,
                "n_heads": 2,
                "n_kv_heads": 2,
                "cap_feat_dim": TINY_TEXT_HIDDEN,
                "axes_dims": [8, 12, 12],  # must sum to the head dim (64 / 2)
            },
        },
    ),
    vae=flux1.VAE,
    text_encoders={
        "text_encoder": Part(
            Qwen3Model, {"full": QWEN3_4B, "tiny": _TINY_QWEN3}, config_class=Qwen3Config, tokenizer="qwen"
        ),
    },
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    # The pad tokens are learned and attended to; left at their zero init they would make padding
    # numerically invisible and hide padding bugs.
    redrawn=("x_pad_token", "cap_pad_token"),
)

# Z-Image Omni (Tongyi-MAI/Z-Image-Omni-Base): the same DiT in its omni mode, reading condition
# images through the VAE and a SigLIP2 so400m vision tower. Its transformer is Z-Image's with
# `siglip_feat_dim` 1152 (SigLIP2 so400m's width: the SigLIP embedder, refiner and pad token); text
# encoder, VAE and scheduler are Z-Image's. The vision tower is google/siglip2-so400m-patch16-naflex
# (27 layers, 1152 wide, 16-pixel patches, at most 256 of them) and its processor
# Siglip2ImageProcessor at those patches, as the release's `siglip` and `siglip_processor` folders
# ship them (their defaults otherwise: [-1, 1] normalisation, bilinear resize).
SIGLIP_WIDTH = 1152
_SIGLIP2_SO400M_NAFLEX: dict[str, Any] = dict(
    hidden_size=SIGLIP_WIDTH,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_channels=3,
    num_patches=256,
    patch_size=16,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
    attention_dropout=0.0,
)
_TINY_SIGLIP2: dict[str, Any] = {
    **_SIGLIP2_SO400M_NAFLEX,
    "hidden_size": TINY_TEXT_HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}

Z_IMAGE_OMNI = Release(
    name="z-image-omni",
    transformer=Part(
        ZImageTransformer2DModel,
        {
            "full": {**Z_IMAGE.transformer.config("full"), "siglip_feat_dim": SIGLIP_WIDTH},
            "tiny": {**Z_IMAGE.transformer.config("tiny"), "siglip_feat_dim": TINY_TEXT_HIDDEN},
        },
    ),
    vae=Z_IMAGE.vae,
    text_encoders=Z_IMAGE.text_encoders,
    scheduler_class=Z_IMAGE.scheduler_class,
    scheduler=Z_IMAGE.scheduler,
    redrawn=(*Z_IMAGE.redrawn, "siglip_pad_token"),
    image_encoders={
        "siglip": Part(
            Siglip2VisionModel,
            {"full": _SIGLIP2_SO400M_NAFLEX, "tiny": _TINY_SIGLIP2},
            config_class=Siglip2VisionConfig,
        )
    },
    image_processors={"siglip_processor": (Siglip2ImageProcessor, dict(patch_size=16, max_num_patches=256))},
)

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (Z_IMAGE, Z_IMAGE_OMNI)
