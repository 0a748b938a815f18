"""Model defaults: steps and guidance from a built-in model's own record where it runs unlike its
family, else from the model's recipe (accel.Recipe.generation_defaults), else, for pipelines the
generic recipe serves, from their family's record in the catalog; sizes and frames by model
(:mod:`pipelines.families.catalog`)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ..families.catalog import known_model, model_generation, pipeline_generation
from .constants import DEFAULT_RESOLUTION

if TYPE_CHECKING:  # accel imports torch: not before it is needed
    from accel import GenerationDefaults


def generation_defaults(pipe: Any) -> GenerationDefaults:
    """How ``pipe`` is usually run: a built-in model's own defaults (a pipeline its family's recipe
    serves but runs otherwise: Z-Image Omni), else its recipe's, else its family's, else what its
    signature allows."""
    from accel import DENOISER_NAMES, GenerationDefaults, recipe_for

    own = model_generation(type(pipe).__name__)
    if own is not None:
        return GenerationDefaults(**own)
    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if module is not None:
            defaults = recipe_for(module)().generation_defaults()
            if defaults is not None:
                return defaults
            break
    known = pipeline_generation(type(pipe).__name__)
    if known is not None:
        return GenerationDefaults(**known)
    # No recipe default: leave the pipeline's own guidance alone, but know its argument's name.
    params = inspect.signature(pipe.__call__).parameters
    if "true_cfg_scale" in params:
        return GenerationDefaults(guidance_kwarg="true_cfg_scale", default_negative=" ")
    if "guidance_scale" in params:
        return GenerationDefaults(guidance_kwarg="guidance_scale")
    return GenerationDefaults()


def _is_builtin_video(model: str) -> bool:
    known = known_model(model)
    return known is not None and known.video


def _video_run(model: str, size: str) -> tuple[tuple[int, int], int] | None:
    """A built-in video model's run at ``size`` that names no resolution or frames, or None."""
    known = known_model(model)
    return known.video_runs.get(size) if known is not None and known.video else None


def is_video_model(model: str) -> bool | None:
    """Whether ``model`` makes videos, known before it is built: a built-in model's (by its name,
    without torch), or a local folder's (its ``model_index.json`` names the class); None for a hub id (or a folder
    whose class diffusers does not know)."""
    import json
    from pathlib import Path

    if known_model(model) is not None:
        return _is_builtin_video(model)
    index = Path(model).expanduser() / "model_index.json"
    try:
        name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    import diffusers

    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not isinstance(cls, type):
        return None
    return "num_frames" in inspect.signature(cls.__call__).parameters


def default_resolution(model: str, size: str) -> tuple[int, int]:
    """The resolution of a run that names none: the built-in video model's own, else 512x512."""
    run = _video_run(model, size)
    return run[0] if run is not None else DEFAULT_RESOLUTION


def default_frames(model: str, size: str, pipe: Any) -> int | None:
    """Frames of a video run that names none (None: ``pipe`` makes images).

    The built-in video model's by size; any other video pipeline's own ``num_frames`` default.
    """
    param = inspect.signature(pipe.__call__).parameters.get("num_frames")
    if param is None:
        return None
    run = _video_run(model, size)
    if run is not None:
        return run[1]
    return param.default if isinstance(param.default, int) and param.default > 0 else None
