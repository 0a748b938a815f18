"""LTX-Video 0.9 (2B): 28 blocks, 32 heads x 64 = 2048 wide, T5-XXL text (128 tokens); the VAE
compresses 32x in space and 8x in time into 128 channels, one token per latent pixel."""

from __future__ import annotations

from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

from ...construction import init_defaults
from ..spec import Embedding, Family, Geometry
from .common import TINY_TEXT, TINY_TEXT_LEN, e, mask, text_length

__all__ = ["FAMILY"]

_FULL = init_defaults(LTXVideoTransformer3DModel)
_TINY = {
    **_FULL,
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "cross_attention_dim": 32,
    "num_layers": 2,
    "caption_channels": TINY_TEXT,
}
_VAE_FULL = init_defaults(AutoencoderKLLTXVideo)
_VAE_TINY = {
    **_VAE_FULL,
    "latent_channels": 8,
    "block_out_channels": (16, 16, 32, 32),
    "decoder_block_out_channels": (16, 16, 32, 32),
    "layers_per_block": (1, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1, 1),
}


def _streams(length: int, width: int) -> dict[str, Embedding]:
    return {
        "prompt_embeds": e(1, length, width),
        "prompt_attention_mask": mask(length, "mask_bool"),
        "negative_prompt_embeds": e(1, length, width),
        "negative_prompt_attention_mask": mask(length, "mask_bool"),
    }


FAMILY = Family(
    name="ltx",
    pipeline="LTXPipeline",
    released="Lightricks/LTX-Video (0.9.x, 2B)",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler=dict(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, shift_terminal=0.1
    ),
    geometry={"full": Geometry(height=512, width=704, frames=121), "tiny": Geometry(64, 64, 9)},
    embeddings={"full": _streams(128, 4096), "tiny": _streams(TINY_TEXT_LEN, TINY_TEXT)},
    extras=text_length(128),
    steps=50,
    guidance={"guidance_scale": 3.0},
    cfg=True,
)
