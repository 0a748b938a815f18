"""Per-signature capture and replay of one callable (a denoiser's forward).

A :class:`GraphRunner` sits where the callable was. Each call is reduced to a
:class:`~accel.graphs.signature.Signature`; a signature that has a captured entry replays it (live
tensors are copied into the entry's static buffers, the breakable graph replays, a copy of its
output is returned). Anything else runs eagerly: capture happens only inside
:meth:`GraphRunner.capturing` (an explicit warm-up) or, when opted in, on first use. A capture
that fails blocks its signature, which then always runs eagerly, and keeps the reason.

The runner dispatches and replays; its parts keep the entries (:mod:`accel.graphs.entries`:
least recently used first, within ``max_entries`` and the memory budget), capture one path
(:mod:`accel.graphs.capture`) and decide what a failure costs (:mod:`accel.graphs.policy`); its
settings are a :class:`~accel.graphs.config.RunnerConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

from . import bcg, containers
from .branches import PathMiss, path_label
from .capture import CaptureScope, Target, capture_session
from .config import RunnerConfig
from .entries import Entry, EntryStore, RunnerStats, StepState
from .errors import GraphMemoryBudgetError
from .policy import CapturePolicy
from .pool import GraphPool
from .signature import Signature, Unopenable, describe_diff, flatten
from .sites import BreakSite

__all__ = ["GraphMemoryBudgetError", "GraphRunner", "RunnerConfig", "RunnerStats", "StepState", "capture_session"]

logger = logging.getLogger(__name__)


class _GivenTwice(Exception):
    """A call gives one container twice: a graph that stores into it would not store as eagerly."""

    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field


_said_no_cuda = False


class GraphRunner:
    """Capture and replay ``fn`` once per call signature.

    Args:
        fn: the callable to accelerate (typically a module's original forward).
        name: used in log messages and reports.
        pool: a :class:`GraphPool` to share with other runners; one is made on first capture
            otherwise.
        capture_scope: a context-manager factory entered around warm-up and capture; the list it
            yields is kept alive with the entry (for caches a graph reads by address).
        config: the settings (:class:`RunnerConfig`); ``settings`` override single fields of it
            (``GraphRunner(fn, debug=True)``).

    Attributes:
        key_extra: called at every call, its result is part of what a call is matched on (a
            step cache's current guidance branch, whose state the graph reads by address).
        state: the :class:`StepState` a capture must leave as one call would (set by whoever
            installs stateful breaks).
        enabled: False: every call runs ``fn`` as it is (no graphs, nothing counted).
        state_types: the types of request-scoped state (a K/V cache a pipeline makes per call):
            a call's objects of these types are matched by structure, not identity, and what the
            call stores into them is put back by every replay (see :mod:`accel.graphs.stores`).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str = "fn",
        pool: GraphPool | None = None,
        capture_scope: CaptureScope | None = None,
        config: RunnerConfig | None = None,
        **settings: Any,
    ) -> None:
        self.config = dataclasses.replace(config or RunnerConfig(), **settings)
        self.fn = fn
        self.name = name
        self.pool = pool
        self.capture_scope = capture_scope
        self.key_extra: Callable[[], Hashable] | None = None
        self.state_types: frozenset[type] = frozenset()
        self.state: StepState | None = None
        # The callable ``fn`` stands for, when ``fn`` wraps it (a hook's forward wraps the
        # module's): refused as a break like ``fn`` itself.
        self.entry: Callable[..., Any] | None = None
        self.enabled = True
        self.counts = RunnerStats()
        self.store = EntryStore(name, self.config.max_entries, self.config.memory_budget, self.counts)
        self.policy = CapturePolicy(self.store, self.counts)
        self.lock = threading.RLock()
        self._logged: set[Hashable] = set()
        self._capturing = 0

    # -- dispatch ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.fn(*args, **kwargs)
        try:
            sig, leaves = flatten(args, kwargs, self.state_types)
        except Unopenable as refused:
            self._log_once(
                ("unopenable", refused.type_name), f"{self.name}: {refused}; such calls run eagerly", logging.WARNING
            )
            self.counts.eager_calls += 1
            return self.fn(*args, **kwargs)
        key = sig.key if self.key_extra is None else (sig.key, self.key_extra())
        entry = self.store.get(key)
        if entry is not None:
            try:
                return self._replay(entry, leaves, args, kwargs)
            except _GivenTwice as twice:
                return self._eager_given_twice(key, twice, args, kwargs)
            except PathMiss as miss:
                return self._on_path_miss(entry, miss, args, kwargs)
            except bcg.CopyBackError as exc:
                # A break returned another constant than at capture (say a mask check that came
                # out the other way): the graph's later segments assumed the old one. This call
                # runs eagerly, its breaks so far not again; the graph stays for calls like the
                # captured one.
                self._log_once(("copy-back", key, str(exc)), f"{self.name}: {exc}; this call runs eagerly")
                self.counts.eager_calls += 1
                with bcg.rerun(exc.memo):
                    return self.fn(*args, **kwargs)
        if not self._capturable(key, leaves):
            self.counts.eager_calls += 1
            return self.fn(*args, **kwargs)
        stale = key in self.store.recapture
        if self._capturing or self.config.capture_on_miss or stale:
            entry = self._capture(key, sig, leaves)
            if entry is not None:
                entry.refill = stale and not self._capturing
                try:
                    return self._replay(entry, leaves, args, kwargs)
                except _GivenTwice as twice:
                    return self._eager_given_twice(key, twice, args, kwargs)
        else:
            self.counts.misses += 1
            if key not in self._logged:  # the reason compares against every entry: only when said
                self._log_once(key, f"{self.name}: no graph for this call; running eagerly. {self._miss_reason(sig)}")
        self.counts.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _on_path_miss(self, entry: Entry, miss: PathMiss, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Finish a call whose replay took a decision value without a graph: capture that path
        (in a warm-up, with ``capture_on_miss``, or for an entry captured again after its graphs
        went stale) or run the call again eagerly, its breaks so far answered from the miss's memo."""
        self.counts.path_misses += 1
        path = miss.path
        on_miss = self.config.capture_on_miss or entry.refill
        room = len(entry.tree.chains) < self.config.max_paths
        if (self._capturing or on_miss) and path not in entry.blocked_paths and room:
            with self.lock:
                chain = self.policy.capture_path(self._target(), entry, miss)
            if chain is not None:
                return self._replay(
                    entry, flatten(args, kwargs, self.state_types)[1], args, kwargs, memo=miss.memo, copied=True
                )
        self._log_once(
            ("path", entry.key, path),
            f"{self.name}: no graph for decision path {path_label(path)} of a captured call; running it eagerly"
            + (
                f" (max_paths={self.config.max_paths} paths captured already)"
                if not room
                else ""
                if on_miss
                else " (warm up with calls that take it, or enable capture on first use)"
            ),
        )
        self.counts.eager_calls += 1
        with bcg.rerun(miss.memo):
            return self.fn(*args, **kwargs)

    def _capture(self, key: Hashable, sig: Signature, leaves: list[torch.Tensor]) -> Entry | None:
        with self.lock:
            if self.pool is None:
                self.pool = GraphPool(leaves[0].device)
            return self.policy.capture_signature(self._target(), key, sig, leaves)

    def _target(self) -> Target:
        """What a capture beginning now runs: the callable, and what surrounds it at this moment."""
        assert self.pool is not None
        return Target(self.fn, self.name, self.config, self.pool, self.capture_scope, self.state, self.entry)

    def _replay(
        self,
        entry: Entry,
        leaves: list[torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        memo: bcg.Memo | None = None,
        copied: bool = False,
    ) -> Any:
        """Replay ``entry`` for this call (``copied``: its inputs are in the static inputs already)."""
        if entry.tree.stores:
            twice = containers.given_twice(args, kwargs, entry.signature.state)
            if twice is not None:
                raise _GivenTwice(twice)
        kept = entry.state_bytes_kept
        out = entry.replay(self.pool, entry.tree, None if copied else leaves, memo, call=(args, kwargs, leaves))
        self.store.used(entry)
        self.counts.replays += 1
        self.counts.state_bytes_kept += entry.state_bytes_kept - kept
        return out

    def _eager_given_twice(
        self, key: Hashable, twice: _GivenTwice, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self._log_once(
            ("given-twice", key),
            f"{self.name}: {twice.field} is a container given twice in one call, which its graph stores into as "
            "two; this call runs eagerly",
        )
        self.counts.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _log_once(self, key: Hashable, message: str, level: int = logging.INFO) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, message)

    def _capturable(self, key: Hashable, leaves: list[torch.Tensor]) -> bool:
        if key in self.store.blocked:
            return False
        if not torch.cuda.is_available():
            global _said_no_cuda
            if not _said_no_cuda:  # once per process, not once per runner: it is the machine
                _said_no_cuda = True
                logger.info("CUDA is not available; graph runners run eagerly (no graphs)")
            return False
        if not leaves or any(t.device.type != "cuda" for t in leaves):
            self._log_once(
                ("not-cuda", key),
                f"{self.name}: call has no CUDA tensors or some on another device; running eagerly",
            )
            return False
        if self.pool is not None and any(t.device != self.pool.device for t in leaves):
            self._log_once(("device", key), f"{self.name}: inputs are not on {self.pool.device}; running eagerly")
            return False
        return True

    def _miss_reason(self, sig: Signature) -> str:
        if not len(self.store):
            return "Nothing is captured yet: call warmup() first, or enable capture on first use."
        best = min((describe_diff(sig, e.signature) for e in self.store.entries.values()), key=len)
        shown = "; ".join(best[:4]) + (f"; and {len(best) - 4} more" if len(best) > 4 else "")
        return f"Nearest captured signature differs in {shown}"

    # -- public surface ----------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self) -> Iterator[GraphRunner]:
        """Inside this block, calls whose signature has no graph capture one (a warm-up)."""
        with capture_session():
            self._capturing += 1
            try:
                yield self
            finally:
                self._capturing -= 1

    def capture(self, *args: Any, **kwargs: Any) -> bool:
        """Capture this call's signature now (no output). True if a graph exists afterwards."""
        try:
            sig, leaves = flatten(args, kwargs, self.state_types)
        except Unopenable as refused:
            self._log_once(
                ("unopenable", refused.type_name), f"{self.name}: {refused}; such calls run eagerly", logging.WARNING
            )
            return False
        key = sig.key if self.key_extra is None else (sig.key, self.key_extra())
        if self.store.get(key) is not None:
            return True
        if not self._capturable(key, leaves):
            return False
        with capture_session():
            return self._capture(key, sig, leaves) is not None

    @property
    def signatures(self) -> list[Signature]:
        """Captured signatures, least recently used first."""
        return [e.signature for e in self.store.entries.values()]

    @property
    def keys(self) -> list[Hashable]:
        """What each captured entry is matched on (its signature's key, with ``key_extra``)."""
        return list(self.store.entries)

    @property
    def blocked(self) -> dict[Hashable, str]:
        """Signatures that failed to capture, with the reason."""
        return dict(self.store.blocked)

    @property
    def found_breaks(self) -> list[BreakSite]:
        """Every function and line a capture of this runner failed on."""
        return self.policy.found_breaks

    def stats(self, memory: bool = True, *, pool: bool = True) -> RunnerStats:
        """A snapshot of the counters; ``memory`` adds byte counts, and with ``pool`` the pool's
        (a snapshot of the allocator: milliseconds on a large pool, so never per call)."""
        pool_bytes = self.pool.resident_bytes() if memory and pool and self.pool is not None else 0
        return self.store.fill(dataclasses.replace(self.counts), memory, pool_bytes)

    def release(self, *, recapture: bool = False) -> int:
        """Drop every captured graph and forget failures; returns how many graphs were dropped.

        ``recapture``: the graphs are stale (what they read changed, say the weights), so each
        dropped signature is captured again on its next call, as is every one already waiting
        to be (dropped by an earlier release while it had no graph); without it those are
        forgotten too.
        """
        with self.lock:
            pending = set(self.store.recapture)
            dropped = self.store.clear()
            self._logged.clear()
            if recapture:
                self.store.recapture.update(pending, dropped)
            return len(dropped)

    def new_sequence(self) -> None:
        """A new sequence of calls begins (a pipeline call): replays with decisions start on the
        path the last sequence took at the same call (see :mod:`accel.graphs.branches`)."""
        for entry in self.store.entries.values():
            entry.tree.new_sequence()

    def block(self, keys: Iterable[Hashable], reason: str) -> None:
        """Drop these signatures' graphs (if any) and run them eagerly from now on, keeping
        ``reason`` in :attr:`blocked` (e.g. another process failed to capture the same call)."""
        with self.lock:
            self.store.block(keys, reason)

    def unmark(self) -> None:
        """Give back every function this runner marked as an eager break."""
        self.policy.unmark()
