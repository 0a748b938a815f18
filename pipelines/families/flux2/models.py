"""FLUX.2 [klein], the built-in models, and how they are run (torch-free: read before torch loads)."""

from __future__ import annotations

import math

from ..records import Family, ModelRecord

FAMILY = Family(
    order=45,
    models=(
        # The 4B step-distilled model: 4 steps, its guidance scale ignored (no CFG, no guidance embedding).
        ModelRecord(
            "flux2-klein",
            "Flux2KleinPipeline",
            ("flux.2-klein", "flux2-klein-4b", "flux.2-klein-4b", "klein"),
            generation=dict(steps=4, guidance=1.0, guidance_kwarg="guidance_scale", cfg_above=math.inf),
        ),
        # The 9B KV model: a reference image's K/V computed at the first step and reused; no guidance argument.
        ModelRecord(
            "flux2-klein-kv",
            "Flux2KleinKVPipeline",
            ("flux.2-klein-kv", "flux2-klein-9b-kv", "flux.2-klein-9b-kv", "klein-kv"),
            generation=dict(steps=4, guidance=None, guidance_kwarg=None, cfg_above=math.inf),
        ),
    ),
)
