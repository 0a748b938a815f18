"""Recipe for FLUX.1 denoisers (diffusers' FluxTransformer2DModel): the generic recipe, plus one
compiled form for its single-stream blocks (:mod:`pipelines.families.flux.forms`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from accel import GenericRecipe

from .forms import single_blocks_without_concat

__all__ = ["FluxRecipe"]


class FluxRecipe(GenericRecipe):
    """The generic recipe, with the single-stream blocks' compiled form (:func:`single_blocks_without_concat`)."""

    name = "flux"
    denoiser_classes = ("FluxTransformer2DModel",)

    def compiled_forms(self, module: torch.nn.Module) -> Callable[[], None]:
        return single_blocks_without_concat(module)
