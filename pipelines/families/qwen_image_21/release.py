"""Qwen-Image 2.1: a 7B single-stream block-causal DiT, a Qwen3-VL-8B text encoder reading the
prompt and any condition images together, and its own 16x RGBA VAE."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from ...construction import init_defaults
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release
from .processor import build_processor

__all__ = ["PROCESSOR_IMAGES", "QWEN_IMAGE_21", "RELEASES", "SCHEDULER", "TRANSFORMER", "VAE"]

# diffusers' defaults are the release: 32 single-stream layers, 32 heads x 128 (inner 4096),
# SwiGLU x3, context_in_dim 4096 (= Qwen3-VL-8B's width), 64 latent channels, unpatched.
_TRANSFORMER = init_defaults(QwenImage21Transformer2DModel)
# The VAE's latent channels: the transformer reads them as they are. Not 4, which the pipeline
# would take for an RGBA condition image already encoded.
_TINY_Z = 8
TRANSFORMER = Part(
    QwenImage21Transformer2DModel,
    {
        "full": _TRANSFORMER,
        "tiny": {
            **_TRANSFORMER,
            "in_channels": _TINY_Z,
            "out_channels": _TINY_Z,
            "num_layers": 2,
            "attention_head_dim": 16,  # flex attention's minimum; sum(axes_dims_rope)
            "num_attention_heads": 2,
            "context_in_dim": TINY_TEXT_HIDDEN,
            "mlp_ratio": 2,
            "axes_dims_rope": (4, 6, 6),
        },
    },
)

# diffusers' defaults are the release: base 96 (decoder 144), z_dim 64, four spatial downsamples
# (the pipeline's vae_scale_factor 16), RGBA, the released latent mean and std.
_VAE = init_defaults(AutoencoderKLQwenImage21)
VAE = Part(
    AutoencoderKLQwenImage21,
    {
        "full": _VAE,
        "tiny": {
            **_VAE,
            "base_dim": 4,
            "decoder_base_dim": 4,
            "z_dim": _TINY_Z,
            "dim_mult": [1, 1, 1, 1, 1],  # five stages: the four downsamples of 16x
            "num_res_blocks": 1,
            "latents_mean": [0.0] * _TINY_Z,
            "latents_std": [1.0] * _TINY_Z,
        },
    },
)

# The published scheduler config was not found offline: resolution-dependent shift with the
# values the pipeline itself falls back to (calculate_shift's 0.5 to 1.15 over 256 to 4096 tokens,
# diffusers' defaults).
SCHEDULER: dict[str, Any] = dict(use_dynamic_shifting=True)

# Qwen3-VL-8B-Instruct's config.json (transformers' names). The tiny one keeps its structure:
# interleaved M-RoPE, a deepstack layer, 16-pixel patches merged 2x2.
_QWEN3_VL_8B: dict[str, Any] = dict(
    text_config=dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        attention_bias=False,
        vocab_size=151936,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        hidden_act="gelu_pytorch_tanh",
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    tie_word_embeddings=False,
)
_TINY_QWEN3_VL: dict[str, Any] = dict(
    text_config=dict(
        hidden_size=TINY_TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        # The three M-RoPE sections sum to head_dim / 2.
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3]},
    ),
    vision_config=dict(
        depth=2,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=TINY_TEXT_HIDDEN,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    ),
    tie_word_embeddings=False,
)

# The processor's image settings by size (processor.py holds Qwen3-VL's): a tiny model's images
# are 32 pixels a side and up, below the released 256x256 minimum, which would otherwise enlarge
# them past the VAE's tokens.
PROCESSOR_IMAGES: dict[str, dict[str, Any]] = {
    "full": {},
    "tiny": {"size": {"shortest_edge": 32 * 32, "longest_edge": 16777216}},
}


def _processor(tokenizer: Any, size: str) -> Any:
    return build_processor(tokenizer, PROCESSOR_IMAGES[size])


QWEN_IMAGE_21 = Release(
    name="qwen-image-2.1",
    transformer=TRANSFORMER,
    vae=VAE,
    text_encoders={
        "text_encoder": Part(
            Qwen3VLForConditionalGeneration,
            {"full": _QWEN3_VL_8B, "tiny": _TINY_QWEN3_VL},
            config_class=Qwen3VLConfig,
            tokenizer="qwen",
        ),
    },
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=SCHEDULER,
    processor=_processor,
)
RELEASES = (QWEN_IMAGE_21,)
