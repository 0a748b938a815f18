"""Qwen-Image's built-in models and how they are run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

FAMILY = Family(
    order=20,
    models=(
        ModelRecord("qwen-image", "QwenImagePipeline", ("qwenimage", "qwen_image")),
        # Called by an input image and a resolution, not by size (families/qwen_image/layered.py).
        ModelRecord("qwen-image-layered", "QwenImageLayeredPipeline", ("qwenimage-layered", "qwen_image_layered")),
    ),
    # True CFG runs only with a negative prompt and a scale above 1.
    generation=dict(steps=20, guidance=4.0, guidance_kwarg="true_cfg_scale", cfg_above=1.0, default_negative=" "),
)
