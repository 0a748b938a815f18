"""Z-Image: a 6B single-stream DiT with a Qwen3-4B text encoder and the FLUX.1 VAE."""

from __future__ import annotations

from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from ...construction import init_defaults
from ...releases.encoders import QWEN3_4B
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release
from ..flux import release as flux1

__all__ = ["RELEASES", "Z_IMAGE"]

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

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (Z_IMAGE,)
