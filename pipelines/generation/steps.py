"""A pipeline call's denoising steps, seen from outside through diffusers' ``callback_on_step_end``.

:class:`StepWatch` is the callback a call passes: it tells ``on_step`` each step that ended (a
progress bar's tick) and, once ``stop`` says the call's work is no longer wanted (its requests
timed out, its clients left), raises :class:`CallStopped` at that step's end. The call then ends
at a step boundary: the denoiser is between forwards (no graph is captured or replayed there), and
:func:`end_stopped_call` runs what the pipeline's own end would have run, so the next call starts
clean. Nothing of the call changes otherwise: the callback hands the latents back untouched.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["CallStopped", "StepWatch", "end_stopped_call", "takes_step_callback"]

logger = logging.getLogger(__name__)

CALLBACK = "callback_on_step_end"


class CallStopped(Exception):
    """A call stopped at the end of step ``step`` (counted from 1) because its work was no longer wanted."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step}")
        self.step = step


class StepWatch:
    """``callback_on_step_end`` for one call: ``on_step(n)`` after step ``n`` (from 1), then
    :class:`CallStopped` if ``stop()`` is true."""

    def __init__(self, on_step: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None) -> None:
        self.on_step = on_step
        self.stop = stop
        self.steps = 0

    def __call__(self, pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.steps = step + 1
        if self.on_step is not None:
            self.on_step(self.steps)
        if self.stop is not None and self.stop():
            raise CallStopped(self.steps)
        return kwargs


def takes_step_callback(pipe: Any) -> bool:
    """Whether ``pipe``'s call takes ``callback_on_step_end``."""
    try:
        return CALLBACK in inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        return False


def end_stopped_call(pipe: Any) -> None:
    """What a stopped call's pipeline would have run at its end: ``maybe_free_model_hooks``, which
    resets the denoiser's stateful hooks (step caches), offloads what was offloaded, and, on an
    accelerated pipeline, ends the call (its lock and the listeners of its end)."""
    free = getattr(pipe, "maybe_free_model_hooks", None)
    if not callable(free):
        return
    try:
        free()
    except Exception:  # the call's stop is what matters: this is said, not raised
        logger.warning("after a stopped call, %s.maybe_free_model_hooks failed", type(pipe).__name__, exc_info=True)
