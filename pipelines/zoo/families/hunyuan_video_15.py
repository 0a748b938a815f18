"""HunyuanVideo-1.5 480p text-to-video (8.3B): 54 blocks, 16 heads x 128 = 2048 wide; text:
Qwen2.5-VL-7B (1000 tokens, 3584 wide) and ByT5 glyph text (256 tokens, 1472 wide); the VAE
compresses 16x in space into 32 channels; the latents are concatenated with a conditioning latent
and a mask (32 + 32 + 1 = 65 input channels). Guidance is a guider."""

from __future__ import annotations

from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

from ...construction import init_defaults
from ..spec import Embedding, Family, Geometry
from .common import TINY_CLIP, TINY_TEXT, TINY_TEXT_LEN, e, mask

__all__ = ["FAMILY"]

_FULL = {**init_defaults(HunyuanVideo15Transformer3DModel), "task_type": "t2v"}
_TINY = {
    **_FULL,
    "in_channels": 2 * 8 + 1,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 16,  # must equal sum(rope_axes_dim)
    "num_layers": 2,
    "num_refiner_layers": 1,
    "text_embed_dim": TINY_TEXT,
    "text_embed_2_dim": TINY_TEXT,
    "image_embed_dim": TINY_TEXT,
    "rope_axes_dim": (4, 6, 6),
}
_VAE_FULL = init_defaults(AutoencoderKLHunyuanVideo15)
_VAE_TINY = {**_VAE_FULL, "latent_channels": 8, "block_out_channels": (16, 16, 32, 32, 32), "layers_per_block": 1}


def _streams(length: int, width: int, length_2: int, width_2: int) -> dict[str, Embedding]:
    out: dict[str, Embedding] = {}
    for prefix in ("", "negative_"):
        out[f"{prefix}prompt_embeds"] = e(1, length, width)
        out[f"{prefix}prompt_embeds_mask"] = mask(length, "mask_int")
        out[f"{prefix}prompt_embeds_2"] = e(1, length_2, width_2)
        out[f"{prefix}prompt_embeds_mask_2"] = mask(length_2, "mask_int")
    return out


FAMILY = Family(
    name="hunyuan-video-1.5",
    pipeline="HunyuanVideo15Pipeline",
    released="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
    denoiser_configs={"full": _FULL, "tiny": _TINY},
    vae_configs={"full": _VAE_FULL, "tiny": _VAE_TINY},
    scheduler=dict(num_train_timesteps=1000, shift=5.0),
    geometry={"full": Geometry(height=480, width=848, frames=33), "tiny": TINY_CLIP},
    embeddings={
        "full": _streams(1000, 3584, 256, 1472),
        "tiny": _streams(TINY_TEXT_LEN, TINY_TEXT, TINY_TEXT_LEN, TINY_TEXT),
    },
    steps=50,
    guidance={},  # the guider's (below); the pipeline takes no guidance keyword
    cfg=True,
    components={"guider": ("ClassifierFreeGuidance", {"guidance_scale": 6.0})},
)
