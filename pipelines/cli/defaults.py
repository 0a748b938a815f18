"""Model defaults: each recipe knows its model's (accel.Recipe.generation_defaults)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # accel imports torch: not before it is needed
    from accel import GenerationDefaults


def generation_defaults(pipe: Any) -> GenerationDefaults:
    """How ``pipe`` is usually run: its recipe's defaults, else what its signature allows."""
    from accel import DENOISER_NAMES, GenerationDefaults, recipe_for

    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if module is not None:
            defaults = recipe_for(module)().generation_defaults()
            if defaults is not None:
                return defaults
            break
    # No recipe default: leave the pipeline's own guidance alone, but know its argument's name.
    params = inspect.signature(pipe.__call__).parameters
    if "true_cfg_scale" in params:
        return GenerationDefaults(guidance_kwarg="true_cfg_scale", default_negative=" ")
    if "guidance_scale" in params:
        return GenerationDefaults(guidance_kwarg="guidance_scale")
    return GenerationDefaults()
