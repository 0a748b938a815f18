"""A pipeline's step loop, found in its family's folder, and the bracket of a pipeline call.

A family that can run its loop a step at a time has a ``steps`` module in its folder
(``pipelines/families/<family>/steps.py``) naming the pipeline classes it re-states
(``PIPELINES``) and a ``Steps`` class made from the pipeline:

    encode(prompts, negatives, cfg)              -> one text per prompt, encoded in one call
    noise(generator, width, height)              -> one row's initial latents
    scheduler(steps, width, height)              -> a scheduler of the row's own, its timesteps set
    predict(latents, timesteps, texts, guidance, cfg, size) -> what the scheduler's step takes
    decode(latents, size)                        -> the pipeline's ``output_type="pt"`` images

Nothing else lists them: adding a family's loop is adding that module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from pipelines.families.catalog import FAMILIES, module_name

from .schedule import refusal

__all__ = ["StepError", "call_bracket", "known_pipelines", "steps_for"]


class StepError(Exception):
    """The pipeline cannot run its loop a step at a time here (one line: why)."""


def _modules() -> Iterator[Any]:
    for family in FAMILIES:
        name = module_name(family, "steps")
        if importlib.util.find_spec(name) is not None:
            yield importlib.import_module(name)


def known_pipelines() -> tuple[str, ...]:
    """The pipeline classes whose loops are re-stated, by name."""
    return tuple(p for m in _modules() for p in m.PIPELINES)


def steps_for(pipe: Any) -> Any:
    """The step loop of ``pipe`` (its family's ``Steps``), or :class:`StepError` saying why none runs."""
    name = type(pipe).__name__
    for module in _modules():
        if name in module.PIPELINES:
            why = refusal(getattr(pipe, "scheduler", None))
            if why is not None:
                raise StepError(why)
            return module.Steps(pipe)
    raise StepError(f"{name}'s loop is not run a step at a time (known: {', '.join(known_pipelines()) or 'none'})")


@contextlib.contextmanager
def call_bracket(pipe: Any) -> Iterator[None]:
    """What a pipeline call does at its start and end, around a step run outside one: the
    accelerator's per-call checks (weights, adapters, Python state) and lock where it has a call
    guard, and the pipeline's ``maybe_free_model_hooks`` (which ends the guard's call)."""
    guard = getattr(vars(pipe).get("accel"), "guard", None)
    if guard is not None:
        guard.begin()
    try:
        yield
    finally:
        pipe.maybe_free_model_hooks()
