"""Recipe for FLUX.2 denoisers (diffusers' Flux2Transformer2DModel): the generic recipe, with the
klein KV model's reference-image K/V cache as request-scoped state.

``Flux2KleinKVPipeline`` runs its first step with the reference image's tokens
(``kv_cache_mode="extract"``): the forward makes a ``Flux2KVCache``, stores each block's reference
K/V in it and returns it beside the noise prediction; every later step passes it back
(``"cached"``) and attends to it without the reference tokens. Named in :attr:`state_types`, the
cache is matched by its structure (which blocks hold K/V of which shape), not by the object each
call makes, so every step after the first replays one graph
(:mod:`accel.graphs.stores`). The warm-up of a KV pipeline calls it with a reference image of
the case's size as well as without one, so both paths are captured; calls with references of
another size warm up with one of theirs (``call_kwargs=dict(image=reference)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from diffusers import Flux2KleinKVPipeline
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache

from accel import GenericRecipe, WarmupCase, warmup_image

__all__ = ["Flux2Recipe"]


class Flux2Recipe(GenericRecipe):
    """The generic recipe for FLUX.2 (dev, klein, klein KV), the KV cache as request-scoped state."""

    name = "flux2"
    denoiser_classes = ("Flux2Transformer2DModel",)
    diffusers_versions = ">=0.42,<0.43"
    state_types = (Flux2KVCache,)

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        calls = list(super().warmup_calls(pipe, case))
        yield from calls
        if isinstance(pipe, Flux2KleinKVPipeline) and "image" not in case.call_kwargs:
            # A reference image of the output's size: its tokens make the first step's call, and
            # its K/V the cache every later step's call is given.
            yield from ({**kwargs, "image": warmup_image(case.width, case.height)} for kwargs in calls)
