"""The zoo's family names, in the order the breadth table lists them (no imports: a front end
checks names before torch and diffusers load)."""

from __future__ import annotations

__all__ = ["NAMES"]

NAMES: tuple[str, ...] = (
    "flux",
    "flux2",
    "sd3",
    "sdxl",
    "wan",
    "wan-1.3b",
    "ltx",
    "hunyuan-video",
    "hunyuan-video-1.5",
    "sana",
    "pixart-sigma",
    "chroma",
    "cogview4",
    "hidream",
    "lumina2",
    "qwen-image-edit",
)
