"""Model defaults: steps and guidance from the model's recipe (accel.Recipe.generation_defaults)
or, for pipelines the generic recipe serves, from the table below; sizes and frames by model."""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from .constants import DEFAULT_RESOLUTION
from .known_models import known_model

if TYPE_CHECKING:  # accel imports torch: not before it is needed
    from accel import GenerationDefaults

# Pipelines whose denoisers have no recipe of their own (accel's GenericRecipe serves them, and
# knows no model), run as their model cards run them. FLUX.1-dev: 28 steps, guidance 3.5 fed to
# its distilled guidance embedding; that is no classifier-free guidance, so none runs whatever
# the scale (cfg_above infinite). Wan2.1: CFG above a scale of 1, as WanPipeline decides.
_PIPELINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "FluxPipeline": dict(steps=28, guidance=3.5, guidance_kwarg="guidance_scale", cfg_above=math.inf),
    "WanPipeline": dict(steps=30, guidance=5.0, guidance_kwarg="guidance_scale", cfg_above=1.0),
}

# Wan2.1's video VAE decodes every frame at full resolution. Full size makes Wan's 480p
# (832x480) at 33 frames; the tiny model stays small: its VAE decodes 5 frames of 512x512 in
# about 7 s on 2 CPU cores, of 256x256 in 2 s (a whole 30-step run there: 3 s). Other built-in
# models, tiny or full, use DEFAULT_RESOLUTION.
_VIDEO_DEFAULTS: dict[str, tuple[tuple[int, int], int]] = {"tiny": ((256, 256), 5), "full": ((832, 480), 33)}


def generation_defaults(pipe: Any) -> GenerationDefaults:
    """How ``pipe`` is usually run: its recipe's defaults, else the table's, else what its signature allows."""
    from accel import DENOISER_NAMES, GenerationDefaults, recipe_for

    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if module is not None:
            defaults = recipe_for(module)().generation_defaults()
            if defaults is not None:
                return defaults
            break
    known = _PIPELINE_DEFAULTS.get(type(pipe).__name__)
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
    if size in _VIDEO_DEFAULTS and _is_builtin_video(model):
        return _VIDEO_DEFAULTS[size][0]
    return DEFAULT_RESOLUTION


def default_frames(model: str, size: str, pipe: Any) -> int | None:
    """Frames of a video run that names none (None: ``pipe`` makes images).

    The built-in video model's by size; any other video pipeline's own ``num_frames`` default.
    """
    param = inspect.signature(pipe.__call__).parameters.get("num_frames")
    if param is None:
        return None
    if size in _VIDEO_DEFAULTS and _is_builtin_video(model):
        return _VIDEO_DEFAULTS[size][1]
    return param.default if isinstance(param.default, int) and param.default > 0 else None
