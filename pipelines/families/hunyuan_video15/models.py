"""HunyuanVideo-1.5 has no built-in model (it runs from a hub id or a local folder); how it is run
(torch-free: read before torch loads)."""

from __future__ import annotations

from ..records import Family

FAMILY = Family(
    order=50,
    # HunyuanVideo15Pipeline's own: 50 steps. Its guidance scale is no call argument but the
    # checkpoint's guider (ClassifierFreeGuidance, which guides above a scale of 1).
    generation=dict(steps=50, guidance=None, guidance_kwarg=None, cfg_above=1.0, default_negative=None),
)
