"""Per-signature capture and replay of one callable (a denoiser's forward).

A :class:`GraphRunner` sits where the callable was. Each call is reduced to a
:class:`~accel.graphs.signature.Signature`; a signature that has a captured entry replays it (live
tensors are copied into the entry's static buffers, the breakable graph replays, a copy of its
output is returned). Anything else runs eagerly: capture happens only inside
:meth:`GraphRunner.capturing` (an explicit warm-up) or, when opted in, on first use. A capture
that fails blocks its signature, which then always runs eagerly, and keeps the reason.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, Protocol

import torch

from . import bcg, discover, tree
from .branches import Chain, GraphTree, PathMiss, path_label
from .pool import GraphPool
from .signature import Signature, describe_diff, flatten

__all__ = ["GraphMemoryBudgetError", "GraphRunner", "RunnerStats", "StepState", "capture_session"]

logger = logging.getLogger(__name__)

CaptureScope = Callable[[], contextlib.AbstractContextManager[list]]

_said_no_cuda = False


class GraphMemoryBudgetError(RuntimeError):
    """A capture was refused because graph memory would exceed the runner's ``memory_budget``.

    A RuntimeError, not a :class:`MemoryError` (nothing ran out of memory: a limit the caller set
    was reached) and not a :class:`~accel.graphs.bcg.BreakError` (those come from the breakable-graph
    core; the budget is the runner's policy). The runner catches it like any capture failure:
    the signature is blocked and runs eagerly, and :attr:`GraphRunner.blocked` keeps the reason.
    """


@dataclasses.dataclass
class RunnerStats:
    """Counters of one runner. Byte counts are filled by :meth:`GraphRunner.stats`.

    ``captures`` counts captured chains: a new signature's first path, and every later path of a
    call with decisions (``path_captures`` of them). ``path_misses``: replays that took a
    decision value without a graph; ``path_switches``: replays that moved to another path's chain
    at a decision. ``paths_per_entry``: the captured decision paths of each signature.
    """

    captures: int = 0
    replays: int = 0
    misses: int = 0
    eager_calls: int = 0
    capture_failures: int = 0
    evictions: int = 0
    capture_seconds: float = 0.0
    path_captures: int = 0
    path_misses: int = 0
    path_switches: int = 0
    entries: int = 0
    segments_per_entry: list[int] = dataclasses.field(default_factory=list)
    paths_per_entry: list[list[str]] = dataclasses.field(default_factory=list)
    pool_bytes: int = 0
    static_bytes: int = 0
    boundary_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StepState(Protocol):
    """State that a call's breaks keep across calls (a step cache's counters and tensors).

    A capture runs the call several times (warm-up runs, the capture pass, a verification); the
    runner takes a snapshot first and restores it after each of those runs, so a capture has the
    effect of exactly one call.
    """

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


@dataclasses.dataclass
class _Entry:
    """One captured signature: its static inputs, and a chain per decision path taken so far."""

    key: Hashable
    signature: Signature
    static_inputs: list[torch.Tensor]
    tree: GraphTree
    blocked_paths: dict[tuple[Any, ...], str] = dataclasses.field(default_factory=dict)

    @property
    def capture_seconds(self) -> float:
        return sum(c.capture_seconds for c in self.tree.chains.values())


# Capture sessions of all threads together: the first to open takes the collector's state and
# turns it off, the last to close restores it, whatever order they close in.
_session_lock = threading.RLock()  # re-entrant: a finaliser run by gc.collect() may open a session
_session_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Collect garbage once and keep the collector off while graphs are captured.

    A collection in the middle of a capture can run finalisers that touch CUDA; collecting once
    per session rather than per segment keeps capture fast. Re-entrant, and shared by threads:
    the collector is back to its state before the first session only when the last one closes.
    """
    _open_session()
    try:
        yield
    finally:
        _close_session()


def _open_session() -> None:
    global _session_depth, _gc_was_enabled
    with _session_lock:
        _session_depth += 1
        if _session_depth > 1:
            return
        _gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            gc.collect()  # under the lock: no other thread starts capturing while finalisers run
        except BaseException:
            _close_session()
            raise


def _close_session() -> None:
    global _session_depth
    with _session_lock:
        _session_depth -= 1
        if _session_depth == 0 and _gc_was_enabled:
            gc.enable()


class GraphRunner:
    """Capture and replay ``fn`` once per call signature.

    Args:
        fn: the callable to accelerate (typically a module's original forward).
        name: used in log messages and reports.
        pool: a :class:`GraphPool` to share with other runners; one is made on first capture
            otherwise.
        capture_on_miss: capture a new signature on first use instead of running it eagerly.
        max_entries: captured signatures kept; once a new capture succeeds beyond it, the least
            recently used is evicted.
        max_segments: a capture with more segments than this is refused (runs eagerly).
        debug: capture the whole call as one eager break, so the model runs eagerly through the
            same static buffers, replay walk and copies; tells capture bugs from model bugs.
        warmup_runs: eager runs on the capture stream before a capture (lazy caches, autotuning).
        capture_scope: a context-manager factory entered around warm-up and capture; the list it
            yields is kept alive with the entry (for caches a graph reads by address).
        memory_budget: bytes of graph memory (the pool, static inputs, boundary buffers) beyond
            which a capture is refused and its signature runs eagerly; None for no limit.
        auto_breaks: when a capture fails on an operation a graph cannot hold, run the function
            that did it as an eager break and capture again; the graph must then equal an eager
            run of the same inputs (else the signature runs eagerly). Off: the failure is only
            located and named in :attr:`blocked`.
        verify: compare every new graph's output with an eager run of the same inputs, bit for
            bit, before keeping it.
        max_auto_breaks: functions marked for one capture at most.

    Attributes:
        found_breaks: every function and line a capture of this runner failed on.
        key_extra: called at every call, its result is part of what a call is matched on (a
            step cache's current guidance branch, whose state the graph reads by address).
        state: the :class:`StepState` a capture must leave as one call would (set by whoever
            installs stateful breaks).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str = "fn",
        pool: GraphPool | None = None,
        capture_on_miss: bool = False,
        max_entries: int = 32,
        max_segments: int = 512,
        debug: bool = False,
        warmup_runs: int = 2,
        capture_scope: CaptureScope | None = None,
        memory_budget: int | None = None,
        auto_breaks: bool = False,
        verify: bool = False,
        max_auto_breaks: int = 8,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.fn = fn
        self.name = name
        self.pool = pool
        self.capture_on_miss = capture_on_miss
        self.max_entries = max_entries
        self.max_segments = max_segments
        self.debug = debug
        self.warmup_runs = warmup_runs
        self.capture_scope = capture_scope
        self.memory_budget = memory_budget
        self.auto_breaks = auto_breaks
        self.verify = verify
        self.max_auto_breaks = max_auto_breaks
        self.found_breaks: list[discover.BreakSite] = []
        self.key_extra: Callable[[], Hashable] | None = None
        self.state: StepState | None = None
        # The callable ``fn`` stands for, when ``fn`` wraps it (a hook's forward wraps the
        # module's): refused as a break like ``fn`` itself.
        self.entry: Callable[..., Any] | None = None
        self._marks: list[Callable[[], None]] = []
        self.enabled = True
        self._recapture: set[Hashable] = set()
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._blocked: dict[Hashable, str] = {}
        self._said: set[Hashable] = set()
        self._capturing = 0
        self._stats = RunnerStats()
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------------------
    # Public surface
    # ---------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.fn(*args, **kwargs)
        sig, leaves = flatten(args, kwargs)
        key = sig.key if self.key_extra is None else (sig.key, self.key_extra())
        entry = self._entries.get(key)
        if entry is not None:
            try:
                return self._replay(entry, leaves)
            except PathMiss as miss:
                return self._on_path_miss(entry, miss, args, kwargs)
            except bcg.CopyBackError as exc:
                # A break returned another constant than at capture (say a mask check that came
                # out the other way): the graph's later segments assumed the old one. This call
                # runs eagerly, its breaks so far not again; the graph stays for calls like the
                # captured one.
                self._say_once(("copy-back", key, str(exc)), f"{self.name}: {exc}; this call runs eagerly")
                self._stats.eager_calls += 1
                with bcg.rerun(getattr(exc, "memo", None)):
                    return self.fn(*args, **kwargs)
        if not self._capturable(key, leaves):
            self._stats.eager_calls += 1
            return self.fn(*args, **kwargs)
        if self._capturing or self.capture_on_miss or key in self._recapture:
            entry = self._capture(key, sig, leaves)
            if entry is not None:
                return self._replay(entry, leaves)
        else:
            self._stats.misses += 1
            if key not in self._said:  # the reason compares against every entry: only when said
                self._say_once(key, f"{self.name}: no graph for this call; running eagerly. {self._miss_reason(sig)}")
        self._stats.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _on_path_miss(self, entry: _Entry, miss: PathMiss, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Finish a call whose replay took a decision value without a graph: capture that path
        (in a warm-up, or with ``capture_on_miss``) or run the call again eagerly, its breaks so
        far answered from the miss's memo."""
        self._stats.path_misses += 1
        path = miss.path
        if (self._capturing or self.capture_on_miss) and not any(path == p[: len(path)] for p in entry.blocked_paths):
            chain = self._capture_path(entry, miss)
            if chain is not None:
                return self._replay(entry, None, memo=miss.memo)
        self._say_once(
            ("path", entry.key, path),
            f"{self.name}: no graph for decision path {path_label(path)} of a captured call; running it eagerly"
            + ("" if self.capture_on_miss else " (warm up with calls that take it, or enable capture on first use)"),
        )
        self._stats.eager_calls += 1
        with bcg.rerun(miss.memo):
            return self.fn(*args, **kwargs)

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
        sig, leaves = flatten(args, kwargs)
        key = sig.key if self.key_extra is None else (sig.key, self.key_extra())
        if key in self._entries:
            return True
        if not self._capturable(key, leaves):
            return False
        with capture_session():
            return self._capture(key, sig, leaves) is not None

    @property
    def signatures(self) -> list[Signature]:
        """Captured signatures, least recently used first."""
        return [e.signature for e in self._entries.values()]

    @property
    def keys(self) -> list[Hashable]:
        """What each captured entry is matched on (its signature's key, with ``key_extra``)."""
        return list(self._entries)

    @property
    def blocked(self) -> dict[Hashable, str]:
        """Signatures that failed to capture, with the reason."""
        return dict(self._blocked)

    def stats(self, memory: bool = True) -> RunnerStats:
        """A snapshot of the counters; ``memory`` adds byte counts (reads the allocator)."""
        s = dataclasses.replace(self._stats)
        s.entries = len(self._entries)
        s.segments_per_entry = [e.tree.num_segments for e in self._entries.values()]
        s.paths_per_entry = [[path_label(p) for p in e.tree.paths] for e in self._entries.values()]
        s.path_switches = sum(e.tree.switches for e in self._entries.values())
        if memory:
            s.static_bytes = sum(t.untyped_storage().nbytes() for e in self._entries.values() for t in e.static_inputs)
            s.boundary_bytes = sum(e.tree.boundary_bytes() for e in self._entries.values())
            s.pool_bytes = self.pool.resident_bytes() if self.pool is not None else 0
        return s

    def release(self) -> None:
        """Drop every captured graph and forget failures and pending recaptures."""
        with self._lock:
            if self._entries and torch.cuda.is_available():
                torch.cuda.synchronize()
            self._entries.clear()
            self._blocked.clear()
            self._said.clear()
            self._recapture.clear()

    def new_sequence(self) -> None:
        """A new sequence of calls begins (a pipeline call): replays with decisions start on the
        path the last sequence took at the same call (see :mod:`accel.graphs.branches`)."""
        for entry in self._entries.values():
            entry.tree.new_sequence()

    def block(self, keys: Iterable[Hashable], reason: str) -> None:
        """Drop these signatures' graphs (if any) and run them eagerly from now on, keeping
        ``reason`` in :attr:`blocked` (e.g. another process failed to capture the same call)."""
        with self._lock:
            keys = list(keys)
            if any(k in self._entries for k in keys) and torch.cuda.is_available():
                torch.cuda.synchronize()  # a replay of one may still be running
            for key in keys:
                self._entries.pop(key, None)
                self._recapture.discard(key)
                self._blocked[key] = reason

    def invalidate(self) -> int:
        """Drop every graph because what they read changed (weights); each dropped signature is
        captured again on its next call. Returns how many graphs were dropped."""
        with self._lock:
            dropped = list(self._entries)
            self.release()
            self._recapture.update(dropped)
            return len(dropped)

    # ---------------------------------------------------------------------------------------
    # Internals
    # ---------------------------------------------------------------------------------------
    def _say_once(self, key: Hashable, message: str, level: int = logging.INFO) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, message)

    def _capturable(self, key: Hashable, leaves: list[torch.Tensor]) -> bool:
        if key in self._blocked:
            return False
        if not torch.cuda.is_available():
            global _said_no_cuda
            if not _said_no_cuda:  # once per process, not once per runner: it is the machine
                _said_no_cuda = True
                logger.info("CUDA is not available; graph runners run eagerly (no graphs)")
            return False
        if not leaves or any(t.device.type != "cuda" for t in leaves):
            self._say_once(
                ("not-cuda", key),
                f"{self.name}: call has no CUDA tensors or some on another device; running eagerly",
            )
            return False
        if self.pool is not None and any(t.device != self.pool.device for t in leaves):
            self._say_once(("device", key), f"{self.name}: inputs are not on {self.pool.device}; running eagerly")
            return False
        return True

    def _miss_reason(self, sig: Signature) -> str:
        if not self._entries:
            return "Nothing is captured yet: call warmup() first, or enable capture on first use."
        best = min((describe_diff(sig, e.signature) for e in self._entries.values()), key=len)
        shown = "; ".join(best[:4]) + (f"; and {len(best) - 4} more" if len(best) > 4 else "")
        return f"Nearest captured signature differs in {shown}"

    def _evict_lru(self) -> None:
        _key, entry = self._entries.popitem(last=False)
        # A replay of it may still be running on the device.
        torch.cuda.current_stream(entry.static_inputs[0].device).synchronize()
        del entry
        self._stats.evictions += 1
        logger.info("%s: evicted the least recently used graph (max_entries=%d)", self.name, self.max_entries)

    def _evictions_to_admit_one(self) -> int:
        return max(0, len(self._entries) + 1 - self.max_entries)

    def _capture(self, key: Hashable, sig: Signature, leaves: list[torch.Tensor]) -> _Entry | None:
        """Warm up and capture this signature; on success evict to make room and keep the entry.

        Nothing is evicted before the capture succeeded: a failed capture must not cost a good
        graph. A capture that fails on an operation a graph cannot hold names its function and
        line; with ``auto_breaks`` that function becomes an eager break and the capture is tried
        again (at most ``max_auto_breaks`` times), and the graph must then equal an eager run.
        On failure the signature is blocked (it runs eagerly) and None comes back.
        """
        with self._lock:
            if self.pool is None:
                self.pool = GraphPool(leaves[0].device)
            with torch.inference_mode(False), torch.no_grad():
                # Allocated outside the pool, owned by the entry: graphs read them by address.
                static_inputs = [torch.empty_like(t) for t in leaves]
                for s, t in zip(static_inputs, leaves):
                    s.copy_(t)
            entry = _Entry(key, sig, static_inputs, GraphTree())
            for _ in range(self.max_auto_breaks + 1):
                try:
                    chain = self._attempt(entry, None)
                except Exception as exc:  # never break generation: block this signature, run eagerly
                    site = self._locate(exc, sig, leaves)
                    if site is not None and self._mark(site):
                        continue
                    reason = f"{type(exc).__name__}: {exc}".strip()
                    if site is not None:
                        reason = f"{reason} (at {site})"
                        if not self.auto_breaks:
                            reason += "; auto_breaks=True would run that function as an eager break and retry"
                    self._fail(key, exc, reason)
                    return None
                for _ in range(self._evictions_to_admit_one()):
                    self._evict_lru()
                entry.tree.add(chain)
                self._entries[key] = entry
                self._recapture.discard(key)
                self._count_capture(chain, "a graph")
                return entry
            self._fail(key, None, f"still failing after {self.max_auto_breaks} automatic breaks")
            return None

    def _capture_path(self, entry: _Entry, miss: PathMiss) -> Chain | None:
        """Capture the path a replay just took (``miss``) as a new chain of ``entry``, during that
        very call: its static inputs already hold the call's inputs, and its breaks so far answer
        from the memo. A failure blocks the path (it runs eagerly) and returns None."""
        with self._lock:
            try:
                chain = self._attempt(entry, miss.memo)
                if chain.path[: len(miss.path)] != miss.path:
                    raise bcg.BreakError(
                        f"the capture took decision path {path_label(chain.path)}, not the call's {path_label(miss.path)}"
                    )
                entry.tree.add(chain)
            except Exception as exc:  # never break generation: this path runs eagerly
                reason = f"{type(exc).__name__}: {exc}".strip()
                entry.blocked_paths[miss.path] = reason
                self._stats.capture_failures += 1
                if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError, GraphMemoryBudgetError)):
                    torch.cuda.empty_cache()
                logger.warning(
                    "%s: capture of decision path %s failed, it runs eagerly from now on: %s",
                    self.name,
                    path_label(miss.path),
                    reason,
                )
                return None
            self._stats.path_captures += 1
            self._count_capture(chain, f"decision path {path_label(chain.path)}")
            return chain

    def _count_capture(self, chain: Chain, what: str) -> None:
        self._stats.captures += 1
        self._stats.capture_seconds += chain.capture_seconds
        logger.info(
            "%s: captured %s in %.2fs (%d segments, breaks: %s)",
            self.name,
            what,
            chain.capture_seconds,
            chain.graph.num_segments,
            ", ".join(sorted(set(chain.graph.break_names))) or "none",
        )

    @contextlib.contextmanager
    def _as_one_call(self) -> Iterator[Callable[[], None]]:
        """Around a capture's runs: yields a function that puts :attr:`state` back as it was when
        the block began (called after each run); the block leaves it so too."""
        state = self.state
        if state is None:
            yield lambda: None
            return
        snapshot = state.snapshot()
        try:
            yield lambda: state.restore(snapshot)
        finally:
            state.restore(snapshot)

    def _attempt(self, entry: _Entry, memo: bcg.Memo | None) -> Chain:
        """One warm-up and capture of a path of ``entry``'s signature (the first if ``memo`` is
        None); raises on any failure (nothing kept). The state breaks keep is left as it was."""
        pool = self.pool
        assert pool is not None
        sig, static_inputs = entry.signature, entry.static_inputs
        target = self.fn
        if self.debug:
            target = bcg.eager_on_graph(self.fn, name=f"{self.name} (debug: whole call eager)", inline_nested=True)
        t0 = time.perf_counter()
        graph = bcg.BreakableCUDAGraph()
        try:
            with torch.inference_mode(False), torch.no_grad(), self._as_one_call() as restore:
                scope = self.capture_scope() if self.capture_scope is not None else contextlib.nullcontext([])
                with pool.lock, scope as keepalive:
                    caller = torch.cuda.current_stream(pool.device)
                    pool.stream.wait_stream(caller)
                    # Fresh containers for every run: a callee that fills a list it is given
                    # (a causal VAE's feature cache) must find it as the caller built it.
                    with torch.cuda.stream(pool.stream):
                        for _ in range(self.warmup_runs):
                            args, kwargs = sig.rebuild(static_inputs)
                            with bcg.rerun(memo):
                                self.fn(*args, **kwargs)
                            restore()
                    pool.stream.synchronize()
                    args, kwargs = sig.rebuild(static_inputs)
                    with bcg.capture(graph, pool=pool.handle_for(graph), stream=pool.stream, memo=memo):
                        output = target(*args, **kwargs)
                    caller.wait_stream(pool.stream)
                    pool.stream.synchronize()
                    restore()
                if graph.num_segments > self.max_segments:
                    raise bcg.BreakError(f"{graph.num_segments} segments exceed max_segments={self.max_segments}")
                if self.memory_budget is not None:
                    # The entries evicted to make room for a new signature do not count.
                    evicted = self._evictions_to_admit_one() if memo is None else 0
                    kept = list(self._entries.values())[evicted:]
                    held = self._graph_memory(kept, entry, graph)
                    if held > self.memory_budget:
                        raise GraphMemoryBudgetError(
                            f"graph memory would be {held / 2**20:.0f} MiB, over the budget of "
                            f"{self.memory_budget / 2**20:.0f} MiB"
                        )
                chain = Chain(graph, output, list(keepalive), time.perf_counter() - t0)
                if self.verify or self._marks:
                    self._verify(entry, chain, memo, restore)
            return chain
        except BaseException:
            graph.reset()
            raise

    def _verify(self, entry: _Entry, chain: Chain, memo: bcg.Memo | None, restore: Callable[[], None]) -> None:
        """Raise unless one replay of ``chain`` equals an eager run of the same inputs bit for bit.

        Breaks found automatically are only as safe as the function's purity, which nothing can
        prove from outside; this comparison is the evidence, for the warmed inputs.
        """
        args, kwargs = entry.signature.rebuild(entry.static_inputs)
        with torch.inference_mode(False), torch.no_grad():
            with bcg.rerun(memo):
                expected = tree.clone(self.fn(*args, **kwargs))
            restore()
            trial = GraphTree()
            trial.add(chain)
            got = self._replay_and_copy(entry, trial, None, memo)
            restore()
        want, have = tree.tensors(expected), tree.tensors(got)
        same = len(want) == len(have) and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, have)
        )
        if not same:
            raise bcg.BreakError(f"{self.name}: the graph's output differs from an eager run of the same inputs")

    def _locate(self, exc: BaseException, sig: Signature, leaves: list[torch.Tensor]) -> discover.BreakSite | None:
        """The function and line a capture failed on, when it failed on a graph-incompatible operation."""
        if self.debug or not discover.is_capture_error(exc):
            return None
        try:
            args, kwargs = sig.rebuild(leaves)
            site = discover.discover(exc, self.fn, args, kwargs)
        except Exception as e:  # a diagnosis must never cost the eager fallback
            logger.debug("%s: could not locate the capture failure: %s", self.name, e)
            return None
        if site is not None and site not in self.found_breaks:
            self.found_breaks.append(site)
        return site

    def _mark(self, site: discover.BreakSite) -> bool:
        """With ``auto_breaks``, run ``site``'s function as an eager break from now on."""
        if not self.auto_breaks:
            return False
        try:
            undo = discover.mark_as_break(site, refuse=self._refused_codes())
        except ValueError as e:
            logger.warning("%s: capture failed at %s; not marked as a break: %s", self.name, site, e)
            return False
        self._marks.append(undo)
        logger.warning(
            "%s: capture failed at %s; running that function as an eager break and retrying", self.name, site
        )
        return True

    def _refused_codes(self) -> set[Any]:
        # The top-level call itself (and what it wraps) must never become a break: that would
        # leave no graph. ``entry`` is the model's own forward where ``fn`` is a wrapper of it.
        codes: set[Any] = set()
        for f in (self.fn, self.entry):
            if f is not None:
                codes |= discover.entry_codes(f)
        return codes

    def unmark(self) -> None:
        """Give back every function this runner marked as an eager break."""
        while self._marks:
            self._marks.pop()()

    def _fail(self, key: Hashable, exc: BaseException | None, reason: str) -> None:
        self._recapture.discard(key)
        self._blocked[key] = reason
        self._stats.capture_failures += 1
        if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError, GraphMemoryBudgetError)):
            torch.cuda.empty_cache()
        logger.warning("%s: capture failed, this signature runs eagerly from now on: %s", self.name, reason)

    def _graph_memory(self, entries: list[_Entry], entry: _Entry, graph: bcg.BreakableCUDAGraph) -> int:
        """Bytes of graph memory with ``entries`` and a new capture (``graph``, a path of
        ``entry``): the whole pool, plus static inputs and boundary buffers, which live outside it."""
        pool = self.pool.resident_bytes() if self.pool is not None else 0
        held = {id(e): e for e in [*entries, entry]}.values()
        inputs = sum(t.untyped_storage().nbytes() for e in held for t in e.static_inputs)
        return pool + inputs + sum(e.tree.boundary_bytes() for e in held) + graph.boundary_bytes()

    def _replay(self, entry: _Entry, leaves: list[torch.Tensor] | None, memo: bcg.Memo | None = None) -> Any:
        out = self._replay_and_copy(entry, entry.tree, leaves, memo)
        self._entries.move_to_end(entry.key)
        self._stats.replays += 1
        return out

    def _replay_and_copy(
        self, entry: _Entry, graphs: GraphTree, leaves: list[torch.Tensor] | None, memo: bcg.Memo | None = None
    ) -> Any:
        """Replay ``graphs`` (``entry``'s tree, or a chain on trial) on the current stream
        (``leaves`` copied into the static inputs first) and return a copy of its output.

        Ordered after the pool's last replay, so the inputs are not rewritten under a replay
        still reading them; marked done only after the copy, so no later replay (on any stream)
        rewrites the output buffers before they are read.
        """
        pool = self.pool
        assert pool is not None
        with pool.lock:
            stream = torch.cuda.current_stream(pool.device)
            pool.order_after_last_replay(stream)
            for s, t in zip(entry.static_inputs, leaves or ()):
                if s is not t:
                    s.copy_(t)
            try:
                chain = graphs.replay(memo)
                # The output buffers are rewritten by the next replay of any graph in the pool,
                # so nothing returned may alias them.
                out = chain.flat_output.clone()
            finally:  # a break that failed leaves segments in flight: order after them too
                pool.mark_replay_done(stream)
        return out
