"""FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B) and 9B KV (black-forest-labs/FLUX.2-klein-9b-kv):
FLUX.2's DiT with a Qwen3 text encoder and FLUX.2's VAE."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from ...construction import init_defaults
from ...releases.encoders import QWEN3_4B
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release

__all__ = ["FLUX2_KLEIN_4B", "FLUX2_KLEIN_9B_KV", "RELEASES", "SCHEDULER", "VAE"]

# Flux2Transformer2DModel's defaults are FLUX.2-dev (8 + 48 blocks, 48 heads, Mistral's 3 x 5120
# text, a guidance embedding); klein's transformer/config.json differ in depth, width and text:
# 4B 5 double- and 20 single-stream blocks, 24 heads x 128 = 3072 wide, Qwen3-4B's 3 x 2560 text;
# 9B 8 + 24 blocks, 32 heads x 128 = 4096, Qwen3-8B's 3 x 4096. Neither has a guidance embedding.
_DEV = init_defaults(Flux2Transformer2DModel)
_KLEIN_4B: dict[str, Any] = {
    **_DEV,
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 3 * 2560,
    "guidance_embeds": False,
}
_KLEIN_9B: dict[str, Any] = {
    **_DEV,
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 3 * 4096,
    "guidance_embeds": False,
}
# What the tiny size changes: one block of each kind, 2 heads of 16 (the four RoPE axes sum to
# the head width), the tiny Qwen3's three stacked layers.
_TINY: dict[str, Any] = {
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 3 * TINY_TEXT_HIDDEN,
    "timestep_guidance_channels": 32,
    "axes_dims_rope": (4, 4, 4, 4),
}

# vae/config.json is AutoencoderKLFlux2's defaults: 32 latent channels, packed 2x2 into the
# transformer's 128 input channels, scale factor 8.
_VAE = init_defaults(AutoencoderKLFlux2)
VAE = Part(
    AutoencoderKLFlux2,
    {
        "full": _VAE,
        "tiny": {**_VAE, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 8},
    },
)

# Qwen3-8B's config.json: Qwen3-4B's depth and heads, wider, embeddings not tied.
_QWEN3_8B: dict[str, Any] = {
    **QWEN3_4B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}
# The klein pipelines stack the hidden states after layers 9, 18 and 27: the tiny encoder keeps 28
# layers, each narrow.
_TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=TINY_TEXT_HIDDEN,
    intermediate_size=64,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=1024,
)

# scheduler/scheduler_config.json, FLUX.2's, beyond diffusers' defaults (FLUX.1's too): the klein
# pipelines pass their own sigmas and an empirical shift (mu) for the image's token count, which
# dynamic shifting takes.
SCHEDULER: dict[str, Any] = dict(shift=3.0, use_dynamic_shifting=True)


def _text_encoder(full: dict[str, Any]) -> Part:
    return Part(Qwen3ForCausalLM, {"full": full, "tiny": _TINY_QWEN3}, config_class=Qwen3Config, tokenizer="qwen")


FLUX2_KLEIN_4B = Release(
    name="flux2-klein",
    transformer=Part(Flux2Transformer2DModel, {"full": _KLEIN_4B, "tiny": {**_KLEIN_4B, **_TINY}}),
    vae=VAE,
    text_encoders={"text_encoder": _text_encoder(QWEN3_4B)},
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=SCHEDULER,
    # model_index.json: the step-distilled model, which runs no classifier-free guidance.
    pipeline_kwargs={"is_distilled": True},
)

FLUX2_KLEIN_9B_KV = Release(
    name="flux2-klein-kv",
    transformer=Part(Flux2Transformer2DModel, {"full": _KLEIN_9B, "tiny": {**_KLEIN_9B, **_TINY}}),
    vae=VAE,
    text_encoders={"text_encoder": _text_encoder(_QWEN3_8B)},
    scheduler_class=FlowMatchEulerDiscreteScheduler,
    scheduler=SCHEDULER,
)

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (FLUX2_KLEIN_4B, FLUX2_KLEIN_9B_KV)
