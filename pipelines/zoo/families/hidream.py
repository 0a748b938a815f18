"""HiDream-I1-Full: 16 double-stream and 32 single-stream blocks, 20 heads x 128 = 2560 wide, a
mixture of 4 experts (2 active) in every feed-forward; text: T5-XXL, and every hidden layer of
Llama-3.1-8B (32 x 4096) of which each block reads one; pooled CLIP-L + CLIP-G (2048)."""

from __future__ import annotations

from typing import Any

from ..spec import Embedding, Family
from .common import FLUX_VAE, GEOMETRY, TINY_GEOMETRY, TINY_TEXT, TINY_TEXT_LEN, e, text_length

__all__ = ["FAMILY"]

_FULL: dict[str, Any] = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=16,
    num_single_layers=32,
    attention_head_dim=128,
    num_attention_heads=20,
    caption_channels=[4096, 4096],
    text_emb_dim=2048,
    num_routed_experts=4,
    num_activated_experts=2,
    axes_dims_rope=(64, 32, 32),
    max_resolution=(128, 128),
    llama_layers=[*range(32), *[31] * 16],
)
_TINY = {
    **_FULL,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
    "num_attention_heads": 2,
    "caption_channels": [TINY_TEXT, TINY_TEXT],
    "text_emb_dim": TINY_TEXT,
    "axes_dims_rope": (8, 4, 4),
    "llama_layers": [0, 1],
}


def _streams(length: int, width: int, llama_layers: int, pooled: int) -> dict[str, Embedding]:
    return {
        "prompt_embeds_t5": e(1, length, width),
        "negative_prompt_embeds_t5": e(1, length, width),
        "prompt_embeds_llama3": e(llama_layers, 1, length, width),
        "negative_prompt_embeds_llama3": e(llama_layers, 1, length, width),
        "pooled_prompt_embeds": e(1, pooled),
        "negative_pooled_prompt_embeds": e(1, pooled),
    }


FAMILY = Family(
    name="hidream",
    pipeline="HiDreamImagePipeline",
    released="HiDream-ai/HiDream-I1-Full",
    scheduler_class="UniPCMultistepScheduler",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs=FLUX_VAE,
    scheduler=dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    geometry=GEOMETRY,
    embeddings={
        "full": _streams(128, 4096, 32, 2048),
        "tiny": _streams(TINY_TEXT_LEN, TINY_TEXT, 2, TINY_TEXT),
    },
    extras=text_length(128),
    steps=50,
    guidance={"guidance_scale": 5.0},
    cfg=True,
    # The pipeline rescales every request to the area of default_sample_size latents (1024x1024
    # pixels); the tiny size keeps its own geometry.
    attributes={"tiny": {"default_sample_size": TINY_GEOMETRY.height // 8}},
)
