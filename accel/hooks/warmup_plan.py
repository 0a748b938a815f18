"""The warm-up plan: what the user asked to warm up, checked, as the cases the recipe's calls will capture.

:func:`plan_warmup` turns what the user said (resolutions, batch sizes, CFG, prompts or lengths,
frame counts, extra call arguments, the guidance setting ``quantize=`` measures) into a validated
:class:`WarmupPlan`, refusing bad input in one line before anything runs. A case (:class:`~accel.hooks.recipes.recipe.WarmupCase`) is a resolution, a frame count (video
pipelines), a batch size, a guidance setting and a text: a length in tokens, or, for a recipe that
cannot measure prompts (the generic one), a prompt warmed up as given. Cases are ordered largest first (smaller
captures then reuse the pool blocks the largest one reserved). :func:`case_calls` gives the
pipeline calls of one case, with the user's ``call_kwargs`` passed with every call;
:mod:`accel.hooks.warmup` runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from .call_shape import call_parameters
from .options import check_resolution
from .recipes.recipe import WARMUP_ARGUMENTS, Recipe, WarmupCase

__all__ = ["WarmupCase", "WarmupPlan", "case_calls", "normalise_resolutions", "plan_warmup"]


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """Every case to capture (each a :class:`~accel.hooks.recipes.recipe.WarmupCase`, with what
    every call shares), largest first. ``call_kwargs`` (left out of the repr, which ranks compare)
    are passed with every call; ``measured``: the index of the case whose first call
    ``quantize=`` measures (:attr:`measured_case`).
    """

    resolutions: tuple[tuple[int, int], ...]
    cases: tuple[WarmupCase, ...]
    call_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    measured: int = 0

    @property
    def measured_case(self) -> WarmupCase:
        """The case ``quantize=``'s layer selection measures (on its first call)."""
        return self.cases[self.measured]

    @property
    def sizes(self) -> list[tuple[int, int, int | None]]:
        """(width, height, frames) of the cases, largest first, each once."""
        return list(dict.fromkeys(c.size for c in self.cases))


def normalise_resolutions(resolutions: Any) -> list[tuple[int, int]]:
    """One ``(width, height)`` or an iterable of them -> unique pairs, largest area first."""
    if isinstance(resolutions, tuple) and len(resolutions) == 2 and all(isinstance(v, int) for v in resolutions):
        resolutions = [resolutions]
    if isinstance(resolutions, (str, bytes)) or not isinstance(resolutions, Iterable):
        raise ValueError(f"resolutions must be (width, height) pairs, got {resolutions!r}")
    out: list[tuple[int, int]] = []
    for r in resolutions:
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise ValueError(f"a resolution is a (width, height) pair of integers, got {r!r}")
        out.append(check_resolution(*r))
    if not out:
        raise ValueError("no resolutions given")
    return sorted(dict.fromkeys(out), key=lambda wh: wh[0] * wh[1], reverse=True)


def _bools(name: str, value: Any) -> tuple[bool, ...]:
    values = (value,) if isinstance(value, bool) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be True, False or a list of them, got {value!r}")
    values = tuple(values)
    if not values or any(not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be True, False or a list of them, got {value!r}")
    return tuple(sorted(set(values), reverse=True))


def _positive_ints(name: str, values: Any) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    values = list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    return values


def _frames(pipe: Any, num_frames: Any) -> tuple[int | None, ...]:
    """The frame counts to capture: those asked for, else the pipeline's default (None: images)."""
    params = call_parameters(pipe)
    if num_frames is None:
        default = params["num_frames"].default if "num_frames" in params else None
        return (default if isinstance(default, int) and not isinstance(default, bool) and default > 0 else None,)
    values = [num_frames] if isinstance(num_frames, int) and not isinstance(num_frames, bool) else num_frames
    try:
        frames = sorted(set(_positive_ints("num_frames", values)), reverse=True)
    except ValueError:
        raise ValueError(f"num_frames must be a positive integer or a list of them, got {num_frames!r}") from None
    if "num_frames" not in params:
        raise ValueError(f"num_frames={num_frames!r}: {type(pipe).__name__} makes images, its call takes no num_frames")
    return tuple(frames)


def _call_kwargs(pipe: Any, call_kwargs: Any) -> dict[str, Any]:
    """``call_kwargs`` as a dict, or ValueError naming the keys the pipeline's call does not take
    (or the warm-up sets itself)."""
    if call_kwargs is None:
        return {}
    if not isinstance(call_kwargs, Mapping) or any(not isinstance(k, str) for k in call_kwargs):
        raise ValueError(f"call_kwargs must be a mapping of pipeline argument names, got {type(call_kwargs).__name__}")
    params = call_parameters(pipe)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in call_kwargs if k not in params]
        if unknown:
            raise ValueError(f"call_kwargs: {type(pipe).__name__}'s call takes no {', '.join(unknown)}")
    owned = [k for k in call_kwargs if k in WARMUP_ARGUMENTS]
    if owned:
        raise ValueError(
            f"call_kwargs: the warm-up sets {', '.join(owned)} itself (from resolutions, num_frames, "
            "num_inference_steps, prompts, negative_prompt, batch_sizes and cfg)"
        )
    return dict(call_kwargs)


def _default_cfg(recipe: Recipe) -> bool | None:
    """Whether the recipe's usual call (its generation defaults) runs guidance; None: unknown."""
    defaults = recipe.generation_defaults()
    if defaults is None or defaults.guidance is None or defaults.guidance_kwarg is None:
        return None
    return defaults.guidance > defaults.cfg_above


def _check_measure_cfg(measure_cfg: Any, asked: tuple[bool, ...]) -> None:
    if measure_cfg is not None and not isinstance(measure_cfg, bool):
        raise ValueError(f"measure_cfg must be None, True or False, got {measure_cfg!r}")
    if measure_cfg is not None and measure_cfg not in asked:
        raise ValueError(f"measure_cfg={measure_cfg}: the warm-up was asked for cfg={list(asked)} only")


def _measured(recipe: Recipe, cases: Sequence[WarmupCase], asked: tuple[bool, ...], measure_cfg: bool | None) -> int:
    """The index of the case ``quantize=`` measures: the largest with the guidance setting
    ``measure_cfg`` (one of ``asked``; None: where both were asked, the recipe's usual call's,
    else the first case's). Guidance multiplies the float8 error of the branches' difference into
    the latents (tiny Z-Image at a scale of 4: about four times the error without), so a selection
    measured with guidance on keeps many more layers in bf16 than calls without it need."""
    wanted = measure_cfg if measure_cfg is not None else (_default_cfg(recipe) if len(asked) > 1 else None)
    # Where the recipe warms that setting up with the other's calls, the first case stands for it.
    return next((i for i, c in enumerate(cases) if c.cfg == wanted), 0)


def plan_warmup(
    recipe: Recipe,
    pipe: Any,
    resolutions: Any,
    *,
    batch_sizes: Sequence[int],
    cfg: bool | Sequence[bool],
    prompt_lengths: Sequence[int] | None,
    prompts: Sequence[str] | None,
    negative_prompt: str | None,
    num_inference_steps: int,
    num_frames: int | Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    measure_cfg: bool | None = None,
) -> WarmupPlan:
    """Validate the user's warm-up request and resolve text lengths through the recipe (for a
    recipe that cannot measure prompts, each prompt is a case of its own, as given);
    ``measure_cfg``: the guidance setting of the case ``quantize=`` measures (see :func:`_measured`)."""
    res = normalise_resolutions(resolutions)
    cfgs = asked = _bools("cfg", cfg)
    _check_measure_cfg(measure_cfg, asked)
    sizes = sorted(set(_positive_ints("batch_sizes", batch_sizes)), reverse=True)
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 2:
        raise ValueError(
            f"num_inference_steps must be an integer of at least 2 (one-step schedules can be degenerate), "
            f"got {num_inference_steps!r}"
        )
    if prompts is not None and prompt_lengths is not None:
        raise ValueError("pass prompts or prompt_lengths, not both")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError(f"negative_prompt must be a string, got {type(negative_prompt).__name__}")
    frames = _frames(pipe, num_frames)
    extra = _call_kwargs(pipe, call_kwargs)
    try:
        negative_length: int | None = recipe.prompt_lengths(pipe, [negative_prompt or ""])[0]
        measures = True
    except NotImplementedError:
        negative_length, measures = None, False
    lengths: list[int] = []
    as_given: list[str] | None = None
    if prompts is not None:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
        if measures:
            lengths = recipe.prompt_lengths(pipe, list(prompts))
        else:
            as_given = list(dict.fromkeys(prompts))
    elif prompt_lengths is not None:
        lengths = _positive_ints("prompt_lengths", prompt_lengths)
    else:
        lengths = list(recipe.default_prompt_lengths())
    if negative_length is None and lengths:
        negative_length = min(lengths)
    cfgs = recipe.warmup_cfg(pipe, cfgs)
    recipe.check_warmup(pipe, cfg=cfgs, call_kwargs=extra)

    def texts(w: int, h: int) -> list[int | str]:
        if as_given is not None:
            return list(as_given)
        return sorted({recipe.warmup_length(n, w, h) for n in lengths}, reverse=True)

    # Largest first, frames counted: smaller captures reuse the blocks the largest reserved.
    shapes = sorted(
        ((w, h, f) for (w, h) in res for f in frames), key=lambda s: s[0] * s[1] * (s[2] or 1), reverse=True
    )
    shared = dict(negative_prompt_length=negative_length, negative_prompt=negative_prompt, call_kwargs=extra)
    cases = tuple(
        WarmupCase(w, h, b, c, n, num_inference_steps, f, **shared)
        for (w, h, f) in shapes
        for b in sizes
        for c in cfgs
        for n in texts(w, h)
    )
    measured = _measured(recipe, cases, asked, measure_cfg)
    return WarmupPlan(tuple(res), cases, extra, measured)


def case_calls(recipe: Recipe, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
    """The recipe's calls of ``case``, each with the user's ``call_kwargs`` merged over it (what
    the warm-up runs; the measurement of ``quantize=`` runs one of them)."""
    for kwargs in recipe.warmup_calls(pipe, case):
        yield {**kwargs, **case.call_kwargs}
