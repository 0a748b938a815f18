"""HunyuanVideo (13B): 20 double-stream and 40 single-stream blocks, 24 heads x 128 = 3072 wide,
Llava-Llama-3-8B text (256 tokens) and pooled CLIP-L; guidance is distilled."""

from __future__ import annotations

from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel

from ...construction import init_defaults
from ..spec import Embedding, Family, Geometry
from .common import TINY_CLIP, TINY_TEXT, TINY_TEXT_LEN, e, mask, text_length

__all__ = ["FAMILY"]

_FULL = init_defaults(HunyuanVideoTransformer3DModel)
_TINY = {
    **_FULL,
    "num_attention_heads": 2,
    "attention_head_dim": 16,  # must equal sum(rope_axes_dim)
    "num_layers": 1,
    "num_single_layers": 1,
    "num_refiner_layers": 1,
    "text_embed_dim": TINY_TEXT,
    "pooled_projection_dim": TINY_TEXT,
    "rope_axes_dim": (4, 6, 6),
}
_VAE_FULL = init_defaults(AutoencoderKLHunyuanVideo)
_VAE_TINY = {**_VAE_FULL, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 8}


def _streams(length: int, width: int, pooled: int) -> dict[str, Embedding]:
    return {
        "prompt_embeds": e(1, length, width),
        "pooled_prompt_embeds": e(1, pooled),
        "prompt_attention_mask": mask(length, "mask_int"),
    }


FAMILY = Family(
    name="hunyuan-video",
    pipeline="HunyuanVideoPipeline",
    released="hunyuanvideo-community/HunyuanVideo",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler=dict(num_train_timesteps=1000, shift=7.0),
    geometry={"full": Geometry(height=544, width=960, frames=33), "tiny": TINY_CLIP},
    embeddings={"full": _streams(256, 4096, 768), "tiny": _streams(TINY_TEXT_LEN, TINY_TEXT, TINY_TEXT)},
    extras=text_length(256),
    steps=50,
    guidance={"guidance_scale": 6.0},  # distilled guidance: an input of one call
    cfg=False,
)
