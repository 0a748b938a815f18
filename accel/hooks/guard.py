"""The per-call guard: where a pipeline call starts and ends, and what is checked there.

A diffusers pipeline call starts by setting its scheduler's timesteps and ends by freeing model
hooks. The guard shadows those two methods (and marks ``scheduler.step`` as an eager break), so
that once per call, never per step:

* calls are serialised across threads (a pipeline keeps per-call state in its scheduler, so two
  threads in one pipeline corrupt each other's images, with or without graphs);
* every accelerated denoiser checks whether its weights moved or changed, or are offloaded;
* listeners (one image on several GPUs, accel/parallel) hear where calls begin and end and
  before every scheduler step.

Pipelines built from one another's components share their scheduler, so the guard belongs to the
scheduler: one lock, one set of checks, shared by every pipeline that uses it, and taken off by
the last of them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from ..graphs import bcg
from .safety import RequestLock, shadow_method, unwrap_method, wrap_method

__all__ = ["CallGuard"]

_guards: weakref.WeakKeyDictionary[Any, CallGuard] = weakref.WeakKeyDictionary()


class CallGuard:
    """Serialises calls and runs checks where calls start; one per scheduler object."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.lock = RequestLock()
        self._checks: dict[int, Callable[[], None]] = {}
        self._users: dict[int, list[tuple[Any, str, Any]]] = {}
        self._shadowed: list[tuple[Any, str, Any]] = []
        # user id -> (begin, step, end); called in that order of events, never per denoiser call.
        self._listeners: dict[int, tuple[Callable[[], None] | None, ...]] = {}
        # The scheduler indexes its sigmas with a Python int that advances every step: inside a
        # graph that would freeze one step. It runs outside the denoiser anyway; marking it
        # eager keeps it eager even if someone captures a larger region.
        if hasattr(scheduler, "step"):
            make = lambda step: bcg.eager_on_graph(self._stepping(step), name="scheduler.step")  # noqa: E731
            self._shadowed.append((scheduler, "step", shadow_method(scheduler, "step", make)))
        if hasattr(scheduler, "set_timesteps"):
            self._shadowed.append(
                (scheduler, "set_timesteps", wrap_method(scheduler, "set_timesteps", before=self.begin))
            )

    @classmethod
    def attach(cls, pipe: Any, user: Any, check: Callable[[], None]) -> CallGuard | None:
        """The guard of ``pipe``'s scheduler, with ``user``'s ``check`` run where calls start.

        None when the pipeline has no scheduler to hook (then calls are neither serialised nor
        checked; warm-ups still check).
        """
        scheduler = getattr(pipe, "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "set_timesteps"):
            return None
        guard = _guards.get(scheduler)
        if guard is None:
            guard = _guards[scheduler] = cls(scheduler)
        guard._checks[id(user)] = check
        ends: list[tuple[Any, str, Any]] = []
        if hasattr(pipe, "maybe_free_model_hooks"):
            ends.append((pipe, "maybe_free_model_hooks", wrap_method(pipe, "maybe_free_model_hooks", after=guard.end)))
        guard._users[id(user)] = ends
        return guard

    def detach(self, user: Any) -> None:
        """Take ``user``'s check and end hook off; the last user takes the guard off."""
        self._checks.pop(id(user), None)
        for obj, name, previous in reversed(self._users.pop(id(user), [])):
            unwrap_method(obj, name, previous)
        if self._users:
            return
        for obj, name, previous in reversed(self._shadowed):
            unwrap_method(obj, name, previous)
        self._shadowed.clear()
        _guards.pop(self.scheduler, None)

    def begin(self) -> None:
        self.lock.begin()
        for check in list(self._checks.values()):
            check()
        for begin, _step, _end in list(self._listeners.values()):
            if begin is not None:
                begin()

    def end(self) -> None:
        for _begin, _step, end in list(self._listeners.values()):
            if end is not None:
                end()
        self.lock.end()

    def listen(
        self,
        user: Any,
        *,
        begin: Callable[[], None] | None = None,
        step: Callable[[], None] | None = None,
        end: Callable[[], None] | None = None,
    ) -> None:
        """Call ``begin`` where a pipeline call starts, ``step`` before each scheduler step and
        ``end`` where the call ends; :meth:`unlisten` takes them off."""
        self._listeners[id(user)] = (begin, step, end)

    def unlisten(self, user: Any) -> None:
        self._listeners.pop(id(user), None)

    def _stepping(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def stepping(*args: Any, **kwargs: Any) -> Any:
            for _begin, on_step, _end in list(self._listeners.values()):
                if on_step is not None:
                    on_step()
            return step(*args, **kwargs)

        return stepping
