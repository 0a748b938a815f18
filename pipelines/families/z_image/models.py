"""Z-Image's built-in model and how it is run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

FAMILY = Family(
    order=10,
    models=(ModelRecord("z-image", "ZImagePipeline", ("zimage", "z_image")),),
    # Turbo-like: few steps, no guidance (the pipeline runs CFG whenever guidance_scale > 0).
    generation=dict(steps=9, guidance=0.0, guidance_kwarg="guidance_scale", cfg_above=0.0, default_negative=None),
)
