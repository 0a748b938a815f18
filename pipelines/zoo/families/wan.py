"""Wan2.1 text-to-video, 14B and 1.3B: the built-in models' denoisers, VAE and schedulers
(:mod:`pipelines.families.wan.release`), a short clip at 480p."""

from __future__ import annotations

from ...releases.configs import scheduler_config, transformer_config, vae_config
from ..spec import Embedding, Family, Geometry
from .common import TINY_CLIP, TINY_TEXT, TINY_TEXT_LEN, e, text_length

__all__ = ["WAN_1_3B", "WAN_14B"]


def _pair(length: int, width: int) -> dict[str, Embedding]:
    return {"prompt_embeds": e(1, length, width), "negative_prompt_embeds": e(1, length, width)}


def _wan(name: str, released: str) -> Family:
    return Family(
        name=name,
        pipeline="WanPipeline",
        released=released,
        scheduler_class="UniPCMultistepScheduler",
        denoiser_configs={s: transformer_config(name, s) for s in ("tiny", "full")},
        vae_configs={s: vae_config(name, s) for s in ("tiny", "full")},
        scheduler=scheduler_config(name),
        geometry={"full": Geometry(height=480, width=832, frames=33), "tiny": TINY_CLIP},
        # UMT5-XXL, padded to the pipeline's 512 tokens.
        embeddings={"full": _pair(512, 4096), "tiny": _pair(TINY_TEXT_LEN, TINY_TEXT)},
        extras=text_length(512),
        steps=50,
        guidance={"guidance_scale": 5.0},
        cfg=True,
        # Text-to-video: no second (low-noise) transformer, as Wan2.1 ships.
        pipeline_kwargs={"transformer_2": None},
    )


WAN_14B = _wan("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers")
WAN_1_3B = _wan("wan-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
