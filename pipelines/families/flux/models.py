"""FLUX.1-dev, the built-in model, and how it is run (torch-free: read before torch loads)."""

from __future__ import annotations

import math

from ..records import Family, ModelRecord

FAMILY = Family(
    order=30,
    models=(ModelRecord("flux", "FluxPipeline", ("flux.1", "flux1", "flux-dev", "flux.1-dev", "flux1-dev")),),
    # As the model card runs it: 28 steps, guidance 3.5 fed to its distilled guidance embedding.
    # That is no classifier-free guidance, so none runs whatever the scale (cfg_above infinite).
    # The generic recipe serves FLUX.1, so front ends read these by pipeline class.
    generation=dict(steps=28, guidance=3.5, guidance_kwarg="guidance_scale", cfg_above=math.inf),
)
