"""Wan2.1's built-in models (14B and 1.3B) and how they are run (torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family, ModelRecord

# The video VAE decodes every frame at full resolution. Full size makes Wan's 480p (832x480) at
# 33 frames; the tiny model stays small, 5 frames of 256x256, which its VAE decodes in seconds on a
# CPU (docs/benchmarks.md).
_RUNS = {"tiny": ((256, 256), 5), "full": ((832, 480), 33)}

FAMILY = Family(
    order=40,
    models=(
        ModelRecord(
            "wan",
            "WanPipeline",
            ("wan2.1", "wan-14b", "wan2.1-14b", "wan2.1-t2v-14b"),
            frames_per_latent=4,
            video_runs=_RUNS,
        ),
        ModelRecord(
            "wan-1.3b", "WanPipeline", ("wan2.1-1.3b", "wan2.1-t2v-1.3b"), frames_per_latent=4, video_runs=_RUNS
        ),
    ),
    # CFG above a scale of 1, as WanPipeline decides. The generic recipe serves Wan2.1, so front
    # ends read these by pipeline class.
    generation=dict(steps=30, guidance=5.0, guidance_kwarg="guidance_scale", cfg_above=1.0),
)
