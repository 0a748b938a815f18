"""Qwen-Image 2.1's built-in model and how it is run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

FAMILY = Family(
    order=60,
    models=(ModelRecord("qwen-image-2.1", "QwenImage21Pipeline", ("qwen-image-21", "qwenimage21", "qwen_image_21")),),
    # Qwen's recommendation (diffusers' docs): 40 steps, no guidance, the pipeline's own scale;
    # true CFG runs only with a negative prompt and a scale above 1.
    generation=dict(steps=40, guidance=None, guidance_kwarg="true_cfg_scale", cfg_above=1.0, default_negative=" "),
)
