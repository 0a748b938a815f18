"""Z-Image's built-in models and how they are run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

FAMILY = Family(
    order=10,
    models=(
        ModelRecord("z-image", "ZImagePipeline", ("zimage", "z_image")),
        # Z-Image-Omni-Base, undistilled: the pipeline's own 50 steps and guidance 5 (both branches
        # in one batch-2 call whenever guidance_scale > 0).
        ModelRecord(
            "z-image-omni",
            "ZImageOmniPipeline",
            ("zimage-omni", "z_image_omni", "z-image-omni-base"),
            generation=dict(
                steps=50, guidance=5.0, guidance_kwarg="guidance_scale", cfg_above=0.0, default_negative=None
            ),
        ),
    ),
    # Turbo-like: few steps, no guidance (the pipeline runs CFG whenever guidance_scale > 0).
    generation=dict(steps=9, guidance=0.0, guidance_kwarg="guidance_scale", cfg_above=0.0, default_negative=None),
)
