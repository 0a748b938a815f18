"""How a graph runner captures, and what a failed capture costs.

A new signature is captured by :meth:`CapturePolicy.capture_signature`: static input buffers,
then one :func:`~accel.graphs.capture.attempt`. A capture that fails on an operation a graph
cannot hold names its function and line (:mod:`accel.graphs.discover`); with ``auto_breaks``
that function becomes an eager break and the capture is tried again (at most
``max_auto_breaks`` times), and the graph must then equal an eager run. Nothing is evicted
before a capture succeeded: a failed capture must not cost a good graph. A failure blocks the
signature (it runs eagerly from now on) and keeps the reason; a decision path that fails to
capture (:meth:`CapturePolicy.capture_path`) is blocked alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch

from . import capture, discover
from .branches import Chain, GraphTree, PathMiss, path_label
from .entries import Entry
from .errors import BreakError, GraphMemoryBudgetError
from .signature import Signature

if TYPE_CHECKING:
    from .runner import GraphRunner

__all__ = ["CapturePolicy"]

# The runner's messages, whichever of its parts says them.
logger = logging.getLogger("accel.graphs.runner")

_OUT_OF_MEMORY = (torch.cuda.OutOfMemoryError, MemoryError, GraphMemoryBudgetError)


class CapturePolicy:
    """The captures of one runner: new signatures, new decision paths, failures and found breaks.

    Attributes:
        found_breaks: every function and line a capture of this runner failed on.
    """

    def __init__(self, runner: GraphRunner) -> None:
        self.runner = runner
        self.found_breaks: list[discover.BreakSite] = []
        self._marks: list[Callable[[], None]] = []

    # -- capturing ---------------------------------------------------------------------------
    def capture_signature(self, key: Hashable, sig: Signature, leaves: list[torch.Tensor]) -> Entry | None:
        """Warm up and capture this signature and keep it; None (the signature blocked) on failure."""
        r = self.runner
        config = r.config
        with r.lock:
            with torch.inference_mode(False), torch.no_grad():
                # Allocated outside the pool, owned by the entry: graphs read them by address.
                static_inputs = [torch.empty_like(t) for t in leaves]
                for s, t in zip(static_inputs, leaves):
                    s.copy_(t)
            entry = Entry(key, sig, static_inputs, GraphTree())
            for _ in range(config.max_auto_breaks + 1):
                try:
                    chain = self._attempt(entry, None)
                except Exception as exc:  # never break generation: block this signature, run eagerly
                    site = self._locate(exc, sig, leaves)
                    if site is not None and self._mark(site):
                        continue
                    reason = f"{type(exc).__name__}: {exc}".strip()
                    if site is not None:
                        reason = f"{reason} (at {site})"
                        if not config.auto_breaks:
                            reason += "; auto_breaks=True would run that function as an eager break and retry"
                    self._fail(key, exc, reason)
                    return None
                entry.tree.add(chain)
                r.store.admit(entry)
                self._count(chain, "a graph")
                return entry
            self._fail(key, None, f"still failing after {config.max_auto_breaks} automatic breaks")
            return None

    def capture_path(self, entry: Entry, miss: PathMiss) -> Chain | None:
        """Capture the path a replay just took (``miss``) as a new chain of ``entry``, during that
        very call: its static inputs already hold the call's inputs, and its breaks so far answer
        from the memo. A failure blocks the path (it runs eagerly) and returns None."""
        r = self.runner
        with r.lock:
            try:
                chain = self._attempt(entry, miss.memo)
                if chain.path[: len(miss.path)] != miss.path:
                    raise BreakError(
                        f"the capture took decision path {path_label(chain.path)}, not the call's {path_label(miss.path)}"
                    )
                entry.tree.add(chain)
            except Exception as exc:  # never break generation: this path runs eagerly
                reason = f"{type(exc).__name__}: {exc}".strip()
                entry.blocked_paths[miss.path] = reason
                r.counts.capture_failures += 1
                if isinstance(exc, _OUT_OF_MEMORY):
                    torch.cuda.empty_cache()
                logger.warning(
                    "%s: capture of decision path %s failed, it runs eagerly from now on: %s",
                    r.name,
                    path_label(miss.path),
                    reason,
                )
                return None
            r.counts.path_captures += 1
            self._count(chain, f"decision path {path_label(chain.path)}")
            return chain

    def _attempt(self, entry: Entry, memo: Any) -> Chain:
        r = self.runner
        pool = r.pool
        assert pool is not None
        return capture.attempt(
            r.fn,
            r.name,
            r.config,
            pool,
            entry,
            memo,
            scope=r.capture_scope,
            state=r.state,
            check_budget=lambda graph: r.store.check_budget(entry, graph, pool, memo is None),
            verified=r.config.verify or bool(self._marks),
        )

    def _count(self, chain: Chain, what: str) -> None:
        r = self.runner
        r.counts.captures += 1
        r.counts.capture_seconds += chain.capture_seconds
        logger.info(
            "%s: captured %s in %.2fs (%d segments, breaks: %s)",
            r.name,
            what,
            chain.capture_seconds,
            chain.graph.num_segments,
            ", ".join(sorted(set(chain.graph.break_names))) or "none",
        )

    def _fail(self, key: Hashable, exc: BaseException | None, reason: str) -> None:
        r = self.runner
        r.store.recapture.discard(key)
        r.store.blocked[key] = reason
        r.counts.capture_failures += 1
        if isinstance(exc, _OUT_OF_MEMORY):
            torch.cuda.empty_cache()
        logger.warning("%s: capture failed, this signature runs eagerly from now on: %s", r.name, reason)

    # -- found breaks ------------------------------------------------------------------------
    def _locate(self, exc: BaseException, sig: Signature, leaves: list[torch.Tensor]) -> discover.BreakSite | None:
        """The function and line a capture failed on, when it failed on a graph-incompatible operation."""
        r = self.runner
        if r.config.debug or not discover.is_capture_error(exc):
            return None
        try:
            args, kwargs = sig.rebuild(leaves)
            site = discover.discover(exc, r.fn, args, kwargs)
        except Exception as e:  # a diagnosis must never cost the eager fallback
            logger.debug("%s: could not locate the capture failure: %s", r.name, e)
            return None
        if site is not None and site not in self.found_breaks:
            self.found_breaks.append(site)
        return site

    def _mark(self, site: discover.BreakSite) -> bool:
        """With ``auto_breaks``, run ``site``'s function as an eager break from now on."""
        r = self.runner
        if not r.config.auto_breaks:
            return False
        try:
            undo = discover.mark_as_break(site, refuse=self._refused_codes())
        except ValueError as e:
            logger.warning("%s: capture failed at %s; not marked as a break: %s", r.name, site, e)
            return False
        self._marks.append(undo)
        logger.warning("%s: capture failed at %s; running that function as an eager break and retrying", r.name, site)
        return True

    def _refused_codes(self) -> set[Any]:
        # The top-level call itself (and what it wraps) must never become a break: that would
        # leave no graph. ``entry`` is the model's own forward where ``fn`` is a wrapper of it.
        codes: set[Any] = set()
        for f in (self.runner.fn, self.runner.entry):
            if f is not None:
                codes |= discover.entry_codes(f)
        return codes

    def unmark(self) -> None:
        """Give back every function this runner marked as an eager break."""
        while self._marks:
            self._marks.pop()()
