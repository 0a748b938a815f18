"""How a graph runner captures, and what a failed capture costs.

A new signature is captured by :meth:`CapturePolicy.capture_signature`: static input buffers,
then one :func:`~accel.graphs.capture.attempt`. A capture that fails on an operation a graph
cannot hold names its function and line (:mod:`accel.graphs.discover`); with ``auto_breaks``
that function becomes an eager break and the capture is tried again (at most
``max_auto_breaks`` times), and the graph must then equal an eager run. Nothing is evicted
before a capture succeeded: a failed capture must not cost a good graph. A capture that runs out
of memory is tried once more after the allocator's cache was emptied, if that gave memory back.
A failure blocks the signature (it runs eagerly from now on) and keeps the reason; a decision
path that fails to capture (:meth:`CapturePolicy.capture_path`) is blocked alone.

The policy keeps what captures leave behind (the runner's entries and counters, the breaks it
found and marked); what it captures comes with each request as a
:class:`~accel.graphs.capture.Target`, so it needs nothing of the runner that asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import capture, discover
from .bindings import entry_codes
from .branches import Chain, GraphTree, PathMiss, path_label
from .capture import Target
from .entries import Entry, EntryStore, RunnerStats
from .errors import BreakError, DeviceMemoryShortError, GraphMemoryBudgetError
from .signature import Signature
from .sites import BreakSite, is_capture_error

__all__ = ["CapturePolicy"]

# The runner's messages, whichever of its parts says them.
logger = logging.getLogger("accel.graphs.runner")

_OUT_OF_MEMORY = (torch.cuda.OutOfMemoryError, MemoryError, GraphMemoryBudgetError, DeviceMemoryShortError)


class CapturePolicy:
    """The captures of one runner: new signatures, new decision paths, failures and found breaks.

    Args:
        store: the runner's entries, where a capture is admitted or its signature blocked.
        counts: the runner's counters.

    Attributes:
        found_breaks: every function and line a capture of this runner failed on.
    """

    def __init__(self, store: EntryStore, counts: RunnerStats) -> None:
        self.store = store
        self.counts = counts
        self.found_breaks: list[BreakSite] = []
        self._marks: list[Callable[[], None]] = []

    # -- capturing ---------------------------------------------------------------------------
    def capture_signature(
        self, target: Target, key: Hashable, sig: Signature, leaves: list[torch.Tensor]
    ) -> Entry | None:
        """Warm up and capture this signature and keep it; None (the signature blocked) on failure."""
        config = target.config
        with torch.inference_mode(False), torch.no_grad():
            # Allocated outside the pool, owned by the entry: graphs read them by address.
            static_inputs = [torch.empty_like(t) for t in leaves]
            for s, t in zip(static_inputs, leaves):
                s.copy_(t)
        entry = Entry(key, sig, static_inputs, GraphTree(), state_inputs=frozenset(sig.state_inputs))
        marks, emptied = 0, False
        while marks <= config.max_auto_breaks:
            try:
                chain = self._attempt(target, entry, None)
            except Exception as exc:  # never break generation: block this signature, run eagerly
                # Cached segments of other pools are not freed while a capture runs; once empty,
                # the device may have room for this one.
                if not emptied and isinstance(exc, torch.cuda.OutOfMemoryError):
                    emptied = True
                    freed = target.pool.release_cached()
                    if freed:
                        logger.info(
                            "%s: capture ran out of memory; emptied %.1f GiB of the allocator's cache, trying once more",
                            target.name,
                            freed / 2**30,
                        )
                        continue
                site = self._locate(target, exc, sig, leaves)
                if site is not None and self._mark(target, site):
                    marks += 1
                    continue
                reason = f"{type(exc).__name__}: {exc}".strip()
                if site is not None:
                    reason = f"{reason} (at {site})"
                    if not config.auto_breaks:
                        reason += "; auto_breaks=True would run that function as an eager break and retry"
                self._fail(target.name, key, exc, reason)
                return None
            entry.tree.add(chain)
            self.store.admit(entry)
            self._count(target.name, chain, "a graph")
            return entry
        self._fail(target.name, key, None, f"still failing after {config.max_auto_breaks} automatic breaks")
        return None

    def capture_path(self, target: Target, entry: Entry, miss: PathMiss) -> Chain | None:
        """Capture the path a replay just took (``miss``) as a new chain of ``entry``, during that
        very call: its static inputs already hold the call's inputs, and its breaks so far answer
        from the memo. A failure blocks the path (it runs eagerly) and returns None."""
        try:
            chain = self._attempt(target, entry, miss.memo)
            if chain.path[: len(miss.path)] != miss.path:
                raise BreakError(
                    f"the capture took decision path {path_label(chain.path)}, not the call's {path_label(miss.path)}"
                )
            entry.tree.add(chain)
        except Exception as exc:  # never break generation: this path runs eagerly
            reason = f"{type(exc).__name__}: {exc}".strip()
            entry.blocked_paths[miss.path] = reason
            self.counts.capture_failures += 1
            if isinstance(exc, _OUT_OF_MEMORY):
                torch.cuda.empty_cache()
            logger.warning(
                "%s: capture of decision path %s failed, it runs eagerly from now on: %s",
                target.name,
                path_label(miss.path),
                reason,
            )
            return None
        self.counts.path_captures += 1
        self._count(target.name, chain, f"decision path {path_label(chain.path)}")
        return chain

    def _attempt(self, target: Target, entry: Entry, memo: Any) -> Chain:
        pool = target.pool
        return capture.attempt(
            target,
            entry,
            memo,
            check_budget=lambda graph: self.store.check_budget(entry, graph, pool, memo is None),
            verified=target.config.verify or bool(self._marks),
        )

    def _count(self, name: str, chain: Chain, what: str) -> None:
        self.counts.captures += 1
        self.counts.capture_seconds += chain.capture_seconds
        logger.info(
            "%s: captured %s in %.2fs (%d segments, breaks: %s)",
            name,
            what,
            chain.capture_seconds,
            chain.graph.num_segments,
            ", ".join(sorted(set(chain.graph.break_names))) or "none",
        )

    def _fail(self, name: str, key: Hashable, exc: BaseException | None, reason: str) -> None:
        self.store.recapture.discard(key)
        self.store.blocked[key] = reason
        self.counts.capture_failures += 1
        if isinstance(exc, _OUT_OF_MEMORY):
            torch.cuda.empty_cache()
        logger.warning("%s: capture failed, this signature runs eagerly from now on: %s", name, reason)

    # -- found breaks ------------------------------------------------------------------------
    def _locate(
        self, target: Target, exc: BaseException, sig: Signature, leaves: list[torch.Tensor]
    ) -> BreakSite | None:
        """The function and line a capture failed on, when it failed on a graph-incompatible operation."""
        if target.config.debug or not is_capture_error(exc):
            return None
        try:
            args, kwargs = sig.rebuild(leaves)
            site = discover.discover(exc, target.fn, args, kwargs)
        except Exception as e:  # a diagnosis must never cost the eager fallback
            logger.debug("%s: could not locate the capture failure: %s", target.name, e)
            return None
        if site is not None and site not in self.found_breaks:
            self.found_breaks.append(site)
        return site

    def _mark(self, target: Target, site: BreakSite) -> bool:
        """With ``auto_breaks``, run ``site``'s function as an eager break from now on."""
        if not target.config.auto_breaks:
            return False
        try:
            undo = discover.mark_as_break(site, refuse=_refused_codes(target))
        except ValueError as e:
            logger.warning("%s: capture failed at %s; not marked as a break: %s", target.name, site, e)
            return False
        self._marks.append(undo)
        logger.warning(
            "%s: capture failed at %s; running that function as an eager break and retrying", target.name, site
        )
        return True

    def unmark(self) -> None:
        """Give back every function this runner marked as an eager break."""
        while self._marks:
            self._marks.pop()()


def _refused_codes(target: Target) -> set[Any]:
    # The top-level call itself (and what it wraps) must never become a break: that would
    # leave no graph. ``wraps`` is the model's own forward where ``fn`` is a wrapper of it.
    codes: set[Any] = set()
    for f in (target.fn, target.wraps):
        if f is not None:
            codes |= entry_codes(f)
    return codes
