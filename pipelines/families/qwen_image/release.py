"""Qwen-Image: a 20B dual-stream DiT with a Qwen2.5-VL-7B text encoder and its own video-style VAE."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from ...construction import init_defaults
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release

__all__ = ["QWEN_IMAGE", "QWEN_IMAGE_LAYERED", "RELEASES", "SCHEDULER", "TRANSFORMER", "VAE"]

# diffusers' defaults are the release: 60 layers, 24 heads x 128, joint_attention_dim 3584 (= the
# width of Qwen2.5-VL-7B).
_TRANSFORMER = init_defaults(QwenImageTransformer2DModel)
TRANSFORMER = Part(
    QwenImageTransformer2DModel,
    {
        "full": _TRANSFORMER,
        "tiny": {
            **_TRANSFORMER,
            "num_layers": 2,
            "attention_head_dim": 32,  # must equal sum(axes_dims_rope)
            "num_attention_heads": 2,
            "joint_attention_dim": TINY_TEXT_HIDDEN,
            "axes_dims_rope": (8, 12, 12),
        },
    },
)

# diffusers' defaults are the release: base_dim 96, z_dim 16, 2 res blocks, temporal downsampling
# on the last two stages (three spatial downsamples -> vae_scale_factor 8).
_VAE = init_defaults(AutoencoderKLQwenImage)
VAE = Part(AutoencoderKLQwenImage, {"full": _VAE, "tiny": {**_VAE, "base_dim": 16, "num_res_blocks": 1}})

# The published scheduler_config beyond diffusers' defaults: resolution-dependent shift (the
# exponential form, diffusers' default).
SCHEDULER: dict[str, Any] = dict(use_dynamic_shifting=True, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02)

# Qwen2.5-VL-7B-Instruct. The tiny one is written whole, its vision tower at Qwen2.5-VL's
# defaults but for the widths.
_QWEN25_VL_7B: dict[str, Any] = dict(
    text_config=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=128000,
        vocab_size=152064,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=28,
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_channels=3,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    tie_word_embeddings=False,
)
_TINY_QWEN25_VL: dict[str, Any] = dict(
    text_config=dict(
        hidden_size=TINY_TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        # head_dim 16: the three M-RoPE sections must sum to head_dim / 2
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
    ),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=TINY_TEXT_HIDDEN),
    tie_word_embeddings=False,
)

QWEN_IMAGE = Release(
    name="qwen-image",
    transformer=TRANSFORMER,
    vae=VAE,
    text_encoders={
        "text_encoder": Part(
            Qwen2_5_VLForConditionalGeneration,
            {"full": _QWEN25_VL_7B, "tiny": _TINY_QWEN25_VL},
            config_class=Qwen2_5_VLConfig,
            tokenizer="qwen",
        ),
    },
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=SCHEDULER,
)

# Qwen-Image Layered (Qwen/Qwen-Image-Layered): the same DiT with a layer-indexed RoPE and a second
# timestep condition (`use_layer3d_rope`, `use_additional_t_cond`; `zero_cond_t` off), splitting an
# RGBA image into RGBA layers; its VAE is Qwen-Image's reading and writing four channels, its text
# encoder and scheduler Qwen-Image's. The pipeline's `processor` (Qwen2VLProcessor, used only to
# caption an image when the prompt is empty) needs torchvision for its video half: the offline
# build leaves it None, so pass a prompt.
_LAYERED: dict[str, Any] = dict(use_layer3d_rope=True, use_additional_t_cond=True, zero_cond_t=False)
QWEN_IMAGE_LAYERED = Release(
    name="qwen-image-layered",
    transformer=Part(TRANSFORMER.cls, {s: {**TRANSFORMER.config(s), **_LAYERED} for s in ("tiny", "full")}),
    vae=Part(VAE.cls, {s: {**VAE.config(s), "input_channels": 4} for s in ("tiny", "full")}),
    text_encoders=QWEN_IMAGE.text_encoders,
    scheduler_class=QWEN_IMAGE.scheduler_class,
    scheduler=QWEN_IMAGE.scheduler,
    absent=("processor",),
)

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (QWEN_IMAGE, QWEN_IMAGE_LAYERED)
