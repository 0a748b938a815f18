"""The per-call guard: where a pipeline call starts and ends, and what is checked there.

A diffusers pipeline call starts by setting its scheduler's timesteps and ends by freeing model
hooks. The guard shadows those two methods (and marks ``scheduler.step`` as an eager break), so
that once per call, never per step:

* calls are serialised across threads (a pipeline keeps per-call state in its scheduler, so two
  threads in one pipeline corrupt each other's images, with or without graphs);
* every accelerated denoiser checks whether its weights, or the Python state its graphs were
  captured in, changed, and whether its weights are offloaded (:mod:`accel.hooks.state.follow`);
* listeners (one image on several GPUs, accel/parallel) hear where calls begin and end and
  before every scheduler step.

Pipelines built from one another's components share their scheduler, so the guard belongs to the
scheduler: one lock, one set of checks, shared by every pipeline that uses it, and taken off by
the last of them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from ...graphs import bcg
from ...graphs.errors import BCGError
from ...graphs.patches import Patch, patch

__all__ = ["BusyError", "CallGuard", "RequestLock"]

# The guard lives in its scheduler's own dictionary, not in a table of the library's: a global
# table's guard would keep its scheduler, and through the checks every accelerated model, alive
# after the user drops the pipeline.
_GUARD_ATTR = "_bcg_call_guard"


class BusyError(BCGError):
    """Another thread has held the pipeline past the request lock's timeout."""


class RequestLock:
    """Serialises whole pipeline calls across threads.

    A diffusers pipeline keeps per-call state (the scheduler's step index, the guidance scale),
    so two threads in one pipeline corrupt each other's images with or without graphs. The lock
    is taken where a call starts (the scheduler's ``set_timesteps``) and given back where it
    ends (``maybe_free_model_hooks``). A call that raised in between leaves the lock with its
    thread, which may start again; other threads wait ``timeout`` seconds, then get a clear error.
    """

    def __init__(self, timeout: float = 600.0) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.timeout = timeout

    def begin(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            return
        if not self._lock.acquire(timeout=self.timeout):
            raise BusyError(
                "this accelerated pipeline has been busy in another thread for "
                f"{self.timeout:.0f}s; diffusers pipelines cannot run concurrently: use one pipeline per "
                "thread, or wait for the other call to finish"
            )
        self._owner = me

    def end(self) -> None:
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    @property
    def busy(self) -> bool:
        return self._owner is not None


def _around(method: Callable[..., Any], before: Callable[[], None] | None, after: Callable[[], None] | None) -> Any:
    """``method`` calling ``before`` and ``after`` around it (``after`` also when it raises)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        try:
            return method(*args, **kwargs)
        finally:
            if after is not None:
                after()

    return wrapper


class CallGuard:
    """Serialises calls and runs checks where calls start; one per scheduler object."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.lock = RequestLock()
        self._checks: dict[int, Callable[[], None]] = {}
        self._users: dict[int, list[Patch]] = {}
        # Through the instances' own dictionaries: a pipeline's __setattr__ would register a component.
        self._shadowed: list[Patch] = []
        # user id -> (begin, step, end); called in that order of events, never per denoiser call.
        self._listeners: dict[int, tuple[Callable[[], None] | None, ...]] = {}
        # The scheduler indexes its sigmas with a Python int that advances every step: inside a
        # graph that would freeze one step. It runs outside the denoiser anyway; marking it
        # eager keeps it eager even if someone captures a larger region.
        if hasattr(scheduler, "step"):
            step = bcg.eager_on_graph(self._stepping(scheduler.step), name="scheduler.step")
            self._shadowed.append(patch(scheduler, "step", step, why="the call guard (an eager break)", where="dict"))
        if hasattr(scheduler, "set_timesteps"):
            begin = _around(scheduler.set_timesteps, self.begin, None)
            self._shadowed.append(patch(scheduler, "set_timesteps", begin, why="the call guard", where="dict"))

    @staticmethod
    def can_attach(pipe: Any) -> bool:
        """Whether ``pipe`` has a scheduler to hook (one with ``set_timesteps``)."""
        scheduler = getattr(pipe, "scheduler", None)
        return scheduler is not None and hasattr(scheduler, "set_timesteps")

    @classmethod
    def attach(cls, pipe: Any, user: Any, check: Callable[[], None]) -> CallGuard | None:
        """The guard of ``pipe``'s scheduler, with ``user``'s ``check`` run where calls start.

        None when the pipeline has no scheduler to hook (:meth:`can_attach`; then calls are
        neither serialised nor checked; warm-ups still check).
        """
        if not cls.can_attach(pipe):
            return None
        scheduler = pipe.scheduler
        guard = vars(scheduler).get(_GUARD_ATTR)
        if guard is None:
            guard = cls(scheduler)
            guard._shadowed.append(patch(scheduler, _GUARD_ATTR, guard, why="the call guard", where="dict"))
        guard._checks[id(user)] = check
        ends: list[Patch] = []
        if hasattr(pipe, "maybe_free_model_hooks"):
            end = _around(pipe.maybe_free_model_hooks, None, guard.end)
            ends.append(patch(pipe, "maybe_free_model_hooks", end, why="the call guard", where="dict"))
        guard._users[id(user)] = ends
        return guard

    def detach(self, user: Any) -> None:
        """Take ``user``'s check and end hook off; the last user takes the guard off."""
        self._checks.pop(id(user), None)
        for end in reversed(self._users.pop(id(user), [])):
            end.undo()
        if self._users:
            return
        for shadow in reversed(self._shadowed):
            shadow.undo()
        self._shadowed.clear()

    def hand_over(self, pipe: Any, user: Any, check: Callable[[], None], listeners: list[Any]) -> CallGuard | None:
        """Move ``user``'s check and the ``listeners`` it owns to the guard of ``pipe``'s scheduler
        now (its pipeline was given another scheduler); None where that one has nothing to hook
        (then ``user`` is off this guard and calls are neither serialised nor checked)."""
        moved = {key: self._listeners.pop(key) for key in [id(x) for x in listeners] if key in self._listeners}
        self.detach(user)
        guard = CallGuard.attach(pipe, user, check)
        if guard is not None:
            guard._listeners.update(moved)
        return guard

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
