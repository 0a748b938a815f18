"""The process side of a parallel run: the process group, liveness, and what ends a rank that is stuck.

While at least one session lives, and only then:

* a watchdog thread ends a rank whose host is blocked behind a collective that will never
  complete (a dead peer mid-kernel): no progress inside a pipeline call for
  ``parallel_timeout_s`` (+ :data:`WATCHDOG_GRACE_S`) prints one line and exits with status 1;
* ``torch.distributed.destroy_process_group`` is wrapped (a :mod:`~accel.graphs.patches` patch)
  to release the sessions' graphs, which may hold collectives, before the group goes (a process
  group destroyed under live graphs hung the exit).

An ``atexit`` handler stays registered while a session lives or the process group a session
created does: it releases the graphs, destroys that group, and exits with status 1 at once where
a session lost a peer, rather than wait on the dead peer. The last session to go, and the
group's destruction, take these away again.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..graphs.patches import Patch, patch
from .errors import PREFIX, ParallelConfigError, ParallelError

__all__ = ["WATCHDOG_GRACE_S", "Liveness", "ensure_process_group", "join", "leave", "leave_process_group"]

logger = logging.getLogger("accel.parallel")

# The watchdog gives a rank blocked in a gloo collective this long past the timeout to fail with
# gloo's own (clearer) error first.
WATCHDOG_GRACE_S = 10.0


class Liveness:
    """One session's progress as the watchdog sees it, and what made the session unusable.

    Attributes:
        broken: set when a collective failed (a peer lost); every later call fails with it, and
            the process exits without waiting on the peer.
        ended: set when the process group was destroyed under the session.
        closed: the session was restored.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.broken: str | None = None
        self.ended: str | None = None
        self.closed = False
        self.in_pipeline_call = False
        self.depth = 0
        self.last_progress = time.monotonic()

    def stamp(self) -> None:
        self.last_progress = time.monotonic()

    def disarm(self) -> None:
        """The pipeline call is over (it raised): the watchdog must not stay armed for it."""
        self.in_pipeline_call = False
        self.stamp()

    def stalled_for(self, now: float) -> float | None:
        """Seconds without progress while a call is in flight on this rank, else None."""
        if self.closed or self.broken is not None or not (self.in_pipeline_call or self.depth):
            return None
        return now - self.last_progress

    def require_usable(self) -> None:
        if self.broken is not None:
            raise ParallelError(f"{PREFIX}: this run cannot continue: {self.broken}")
        if self.ended is not None:
            raise ParallelError(f"{PREFIX}: {self.ended}")
        if self.closed:
            raise ParallelError(f"{PREFIX}: this session was closed (restore); call accelerate_pipeline again")


class Session(Protocol):
    """What the process handlers ask of a live session."""

    liveness: Liveness
    rank: int
    world: int

    def release(self) -> None: ...

    def process_group_destroyed(self) -> None: ...


_lock = threading.Lock()
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_created_default_group = False
_watchdog_stop: threading.Event | None = None
_destroy_patches: list[Patch] = []
_at_exit_registered = False


def _sessions() -> list[Session]:
    with _lock:
        return list(_live)


def join(session: Session) -> None:
    """``session`` is live: the watchdog and the destroy_process_group wrap watch it."""
    with _lock:
        _live.add(session)
    _update_handlers()


def leave(session: Session) -> None:
    """``session`` closed; the last to close takes the watchdog and the wrap away."""
    with _lock:
        _live.discard(session)
    _update_handlers()


def _update_handlers() -> None:
    global _watchdog_stop, _at_exit_registered
    with _lock:
        live = bool(_live)
        if live and _watchdog_stop is None:
            _watchdog_stop = threading.Event()
            threading.Thread(
                target=_watchdog, args=(_watchdog_stop,), name="bcg-parallel-watchdog", daemon=True
            ).start()
            from torch.distributed import distributed_c10d

            original = dist.destroy_process_group
            wrap = _destroying(original)
            why = "releases graphs before the process group goes (parallel=)"
            _destroy_patches.extend(
                [
                    patch(dist, "destroy_process_group", wrap, why=why),
                    patch(distributed_c10d, "destroy_process_group", wrap, why=why),
                ]
            )
        elif not live and _watchdog_stop is not None:
            _watchdog_stop.set()
            _watchdog_stop = None
            while _destroy_patches:
                _destroy_patches.pop().undo()
        wanted = live or _created_default_group
        if wanted and not _at_exit_registered:
            atexit.register(_at_exit)
        elif not wanted and _at_exit_registered:
            atexit.unregister(_at_exit)
        _at_exit_registered = wanted


def _destroying(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        # A process group destroyed while graphs holding its collectives live hung the exit.
        if group is None or group is dist.GroupMember.WORLD:
            for s in _sessions():
                s.process_group_destroyed()
        return original(group)

    return destroy_process_group


def unwrapped_destroy() -> Callable[..., Any]:
    """torch's destroy_process_group as it was before the wrap (the wrap itself is not needed)."""
    return _destroy_patches[0].original if _destroy_patches else dist.destroy_process_group


def _hard_exit(message: str) -> None:
    """Print one line and end the process with status 1, without waiting on dead peers.

    Straight to stderr, not through logging: a configuration that silences this logger must
    not make the process vanish without a word.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    os._exit(1)


def _watchdog(stop: threading.Event) -> None:
    while not stop.wait(0.5):
        now = time.monotonic()
        for s in _sessions():
            live = s.liveness
            stalled = live.stalled_for(now)
            if stalled is not None and stalled > live.timeout + WATCHDOG_GRACE_S:
                _hard_exit(
                    f"{PREFIX}: rank {s.rank} of {s.world}: no progress for {stalled:.0f}s inside a pipeline call "
                    f"(parallel_timeout_s={live.timeout:g}): another rank has probably died or hung; exiting"
                )


def _at_exit() -> None:
    sessions = _sessions()
    for s in sessions:
        if s.liveness.broken is not None:
            _hard_exit(f"{PREFIX}: exiting without waiting for the other ranks: {s.liveness.broken}")
    for s in sessions:
        with contextlib.suppress(Exception):
            s.release()
    if _created_default_group and dist.is_initialized():
        with contextlib.suppress(Exception):
            unwrapped_destroy()()


def ensure_process_group(device: torch.device, timeout_s: float, parallel: str) -> None:
    """Join the launch's process group, creating it (with ``timeout_s``) if nobody has."""
    global _created_default_group
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "MASTER_ADDR" not in os.environ:
        raise ParallelConfigError(
            f"parallel={parallel!r} needs several processes: start the script with torchrun --nproc_per_node 2 "
            "or accelerate launch --num_processes 2 (this process runs alone)"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _created_default_group = True
    logger.info("joined a %s process group of %d ranks (timeout %gs)", backend, world, timeout_s)


def leave_process_group(broken: bool) -> None:
    """Destroy the default process group if a session created it and none lives any more."""
    global _created_default_group
    if _created_default_group and dist.is_initialized() and not _sessions():
        if not broken:
            unwrapped_destroy()()
        _created_default_group = False
    _update_handlers()
