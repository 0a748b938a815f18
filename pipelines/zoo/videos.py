"""Text-to-video families at their released denoiser configs (see :mod:`pipelines.zoo.images`).

Wan2.1 (14B and 1.3B) comes from :mod:`pipelines.builders`; LTX-Video, HunyuanVideo and
HunyuanVideo-1.5 are diffusers' constructor defaults, which are those releases (HunyuanVideo-1.5's
but for its task type). The geometry is a short clip at each model's usual resolution.
"""

from __future__ import annotations

from diffusers import (
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTXVideo,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoTransformer3DModel,
    LTXVideoTransformer3DModel,
)

from .. import builders
from .images import TINY_TEXT, TINY_TEXT_LEN
from .spec import Embedding, Family, Geometry

__all__ = ["VIDEO_FAMILIES"]

# Wan and HunyuanVideo compress time 4x (4k + 1 frames); LTX-Video 8x (8k + 1).
TINY_CLIP = Geometry(height=64, width=64, frames=5)


def _e(*shape: int) -> Embedding:
    return Embedding(tuple(shape))


def _wan(name: str, released: str) -> Family:
    def pair(length: int, width: int) -> dict[str, Embedding]:
        return {"prompt_embeds": _e(1, length, width), "negative_prompt_embeds": _e(1, length, width)}

    return Family(
        name=name,
        pipeline="WanPipeline",
        released=released,
        denoiser="transformer",
        denoiser_class="WanTransformer3DModel",
        vae_class="AutoencoderKLWan",
        scheduler_class="UniPCMultistepScheduler",
        denoiser_configs={s: builders.transformer_config(name, s) for s in ("tiny", "full")},
        vae_configs={s: builders.vae_config(name, s) for s in ("tiny", "full")},
        scheduler=builders.scheduler_config(name),
        geometry={"full": Geometry(height=480, width=832, frames=33), "tiny": TINY_CLIP},
        # UMT5-XXL, padded to the pipeline's 512 tokens.
        embeddings={"full": pair(512, 4096), "tiny": pair(TINY_TEXT_LEN, TINY_TEXT)},
        extras={"full": {"max_sequence_length": 512}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=50,
        guidance={"guidance_scale": 5.0},
        cfg=True,
        # Text-to-video: no second (low-noise) transformer, as Wan2.1 ships.
        pipeline_kwargs={"transformer_2": None},
    )


def _ltx() -> Family:
    # LTX-Video 0.9 (2B): 28 blocks, 32 heads x 64 = 2048 wide, T5-XXL text (128 tokens); the
    # VAE compresses 32x in space and 8x in time into 128 channels, one token per latent pixel.
    full = builders.init_defaults(LTXVideoTransformer3DModel)
    tiny = {
        **full,
        "in_channels": 8,
        "out_channels": 8,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "cross_attention_dim": 32,
        "num_layers": 2,
        "caption_channels": TINY_TEXT,
    }
    vae_full = builders.init_defaults(AutoencoderKLLTXVideo)
    vae_tiny = {
        **vae_full,
        "latent_channels": 8,
        "block_out_channels": (16, 16, 32, 32),
        "decoder_block_out_channels": (16, 16, 32, 32),
        "layers_per_block": (1, 1, 1, 1, 1),
        "decoder_layers_per_block": (1, 1, 1, 1, 1),
    }

    def streams(length: int, width: int) -> dict[str, Embedding]:
        return {
            "prompt_embeds": _e(1, length, width),
            "prompt_attention_mask": Embedding((1, length), "mask_bool"),
            "negative_prompt_embeds": _e(1, length, width),
            "negative_prompt_attention_mask": Embedding((1, length), "mask_bool"),
        }

    return Family(
        name="ltx",
        pipeline="LTXPipeline",
        released="Lightricks/LTX-Video (0.9.x, 2B)",
        denoiser="transformer",
        denoiser_class="LTXVideoTransformer3DModel",
        vae_class="AutoencoderKLLTXVideo",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler=dict(
            num_train_timesteps=1000,
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.95,
            max_shift=2.05,
            base_image_seq_len=1024,
            max_image_seq_len=4096,
            shift_terminal=0.1,
            time_shift_type="exponential",
        ),
        geometry={"full": Geometry(height=512, width=704, frames=121), "tiny": Geometry(64, 64, 9)},
        embeddings={"full": streams(128, 4096), "tiny": streams(TINY_TEXT_LEN, TINY_TEXT)},
        extras={"full": {"max_sequence_length": 128}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=50,
        guidance={"guidance_scale": 3.0},
        cfg=True,
    )


def _hunyuan_video() -> Family:
    # HunyuanVideo (13B): 20 double-stream and 40 single-stream blocks, 24 heads x 128 = 3072
    # wide, Llava-Llama-3-8B text (256 tokens) and pooled CLIP-L; guidance is distilled.
    full = builders.init_defaults(HunyuanVideoTransformer3DModel)
    tiny = {
        **full,
        "num_attention_heads": 2,
        "attention_head_dim": 16,  # must equal sum(rope_axes_dim)
        "num_layers": 1,
        "num_single_layers": 1,
        "num_refiner_layers": 1,
        "text_embed_dim": TINY_TEXT,
        "pooled_projection_dim": TINY_TEXT,
        "rope_axes_dim": (4, 6, 6),
    }
    vae_full = builders.init_defaults(AutoencoderKLHunyuanVideo)
    vae_tiny = {**vae_full, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 8}

    def streams(length: int, width: int, pooled: int) -> dict[str, Embedding]:
        return {
            "prompt_embeds": _e(1, length, width),
            "pooled_prompt_embeds": _e(1, pooled),
            "prompt_attention_mask": Embedding((1, length), "mask_int"),
        }

    return Family(
        name="hunyuan-video",
        pipeline="HunyuanVideoPipeline",
        released="hunyuanvideo-community/HunyuanVideo",
        denoiser="transformer",
        denoiser_class="HunyuanVideoTransformer3DModel",
        vae_class="AutoencoderKLHunyuanVideo",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler=dict(num_train_timesteps=1000, shift=7.0),
        geometry={"full": Geometry(height=544, width=960, frames=33), "tiny": TINY_CLIP},
        embeddings={"full": streams(256, 4096, 768), "tiny": streams(TINY_TEXT_LEN, TINY_TEXT, TINY_TEXT)},
        extras={"full": {"max_sequence_length": 256}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=50,
        guidance={"guidance_scale": 6.0},  # distilled guidance: an input of one call
        cfg=False,
    )


def _hunyuan_video_15() -> Family:
    # HunyuanVideo-1.5 480p text-to-video (8.3B): 54 blocks, 16 heads x 128 = 2048 wide; text:
    # Qwen2.5-VL-7B (1000 tokens, 3584 wide) and ByT5 glyph text (256 tokens, 1472 wide); the
    # VAE compresses 16x in space into 32 channels; the latents are concatenated with a
    # conditioning latent and a mask (32 + 32 + 1 = 65 input channels). Guidance is a guider.
    full = {**builders.init_defaults(HunyuanVideo15Transformer3DModel), "task_type": "t2v"}
    tiny = {
        **full,
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
    vae_full = builders.init_defaults(AutoencoderKLHunyuanVideo15)
    vae_tiny = {**vae_full, "latent_channels": 8, "block_out_channels": (16, 16, 32, 32, 32), "layers_per_block": 1}

    def streams(length: int, width: int, length_2: int, width_2: int) -> dict[str, Embedding]:
        out: dict[str, Embedding] = {}
        for prefix in ("", "negative_"):
            out[f"{prefix}prompt_embeds"] = _e(1, length, width)
            out[f"{prefix}prompt_embeds_mask"] = Embedding((1, length), "mask_int")
            out[f"{prefix}prompt_embeds_2"] = _e(1, length_2, width_2)
            out[f"{prefix}prompt_embeds_mask_2"] = Embedding((1, length_2), "mask_int")
        return out

    return Family(
        name="hunyuan-video-1.5",
        pipeline="HunyuanVideo15Pipeline",
        released="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
        denoiser="transformer",
        denoiser_class="HunyuanVideo15Transformer3DModel",
        vae_class="AutoencoderKLHunyuanVideo15",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler=dict(num_train_timesteps=1000, shift=5.0),
        geometry={"full": Geometry(height=480, width=848, frames=33), "tiny": TINY_CLIP},
        embeddings={
            "full": streams(1000, 3584, 256, 1472),
            "tiny": streams(TINY_TEXT_LEN, TINY_TEXT, TINY_TEXT_LEN, TINY_TEXT),
        },
        steps=50,
        guidance={},  # the guider's (below); the pipeline takes no guidance keyword
        cfg=True,
        components={"guider": ("ClassifierFreeGuidance", {"guidance_scale": 6.0})},
    )


VIDEO_FAMILIES: tuple[Family, ...] = (
    _wan("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    _wan("wan-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    _ltx(),
    _hunyuan_video(),
    _hunyuan_video_15(),
)
