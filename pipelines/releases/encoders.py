"""The text encoders several families ship, as config arguments: CLIP and T5 (FLUX.1, Wan2.1),
Qwen3-4B (Z-Image, FLUX.2 klein 4B). Their token ids and tiny vocabularies come from the offline
tokenizers: see :class:`pipelines.releases.spec.Part`."""

from __future__ import annotations

from typing import Any

from ..tokenizers_t5_clip import CLIP_MAX_LENGTH
from .spec import TINY_TEXT_HIDDEN

__all__ = ["CLIP_L_TEXT", "QWEN3_4B", "T5_V1_1_XXL", "TINY_CLIP_TEXT", "TINY_T5", "UMT5_XXL"]

# FLUX.1-dev text_encoder/config.json: the text tower of openai/clip-vit-large-patch14.
CLIP_L_TEXT: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=CLIP_MAX_LENGTH,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)
# What the tiny size changes.
TINY_CLIP_TEXT: dict[str, Any] = dict(
    hidden_size=TINY_TEXT_HIDDEN,
    intermediate_size=64,
    projection_dim=TINY_TEXT_HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=2,
)

# FLUX.1-dev text_encoder_2/config.json: the encoder of google/t5-v1_1-xxl.
T5_V1_1_XXL: dict[str, Any] = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)
# Wan2.1 text_encoder/config.json (both sizes): the encoder of google/umt5-xxl, T5-XXL's shapes
# with a 256k multilingual vocabulary and a relative position bias in every layer.
UMT5_XXL: dict[str, Any] = {**T5_V1_1_XXL, "vocab_size": 256384}
# What the tiny size changes in either.
TINY_T5: dict[str, Any] = dict(d_model=TINY_TEXT_HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2)

# Qwen3-4B's config.json (Z-Image's text encoder, and FLUX.2 klein 4B's).
QWEN3_4B: dict[str, Any] = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    attention_bias=False,
    use_sliding_window=False,
    max_window_layers=36,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
