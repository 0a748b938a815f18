"""Qwen-Image's built-in model and how it is run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

FAMILY = Family(
    order=20,
    models=(ModelRecord("qwen-image", "QwenImagePipeline", ("qwenimage", "qwen_image")),),
    # True CFG runs only with a negative prompt and a scale above 1.
    generation=dict(steps=20, guidance=4.0, guidance_kwarg="true_cfg_scale", cfg_above=1.0, default_negative=" "),
)
