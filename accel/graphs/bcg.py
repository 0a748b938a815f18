"""Breakable CUDA graphs: one captured region as a chain of CUDA-graph segments and eager breaks.

A CUDA graph cannot hold work that synchronises with the host, copies from pageable host memory,
or produces data-dependent shapes. Instead of giving up on the whole forward, functions that do
such things are marked with :func:`eager_on_graph`. Capturing a region then yields::

    segment 0 -> break 0 -> segment 1 -> break 1 -> ... -> segment N

where every segment is an ordinary :class:`torch.cuda.CUDAGraph` captured into one shared memory
pool on one capture stream, and every break re-runs the marked function eagerly at replay time.

Contract (see the project's design notes):

* Outside a capture a marked function is a plain call.
* During a capture, calling a marked function closes the current segment, runs the function once
  eagerly, keeps its output as the *boundary buffer* (fixed address, strong reference), opens the
  next segment and returns the boundary buffer, so later segments are recorded against its
  address. On replay the function runs again with the same argument objects, whose storage the
  previous segment has just rewritten, and its fresh output is copied into the boundary buffer.
* Copy-back is strict: a different structure, shape, dtype or constant raises
  :class:`CopyBackError` naming the break and the field. Outputs are walked by :mod:`accel.graphs.tree`
  (tensors, tuples, lists, dicts, namedtuples, dataclasses, model outputs, plain objects).
* Replay is a flat walk over segments and breaks on the current stream, with no host sync.
* During capture each segment is replayed once as soon as it is closed, so a break runs on the
  values it will see at every replay, and the constants it returns (which later segments were
  recorded under) are the real ones. The capture pass's final output is still only recorded:
  replay to get real values.
* A *decision* (``eager_on_graph(decision=True)``) is a break whose result is a small host value
  (a bool, an int, a string, None, or a tuple of them) that picks what the code does next. A
  capture records the values its decisions took (:attr:`BreakableCUDAGraph.path`); the segments
  after a decision are the continuation for that value only. :mod:`accel.graphs.branches` keeps one chain
  per path and picks the chain at replay; a chain's own replay never follows another value.
* ``keeps_inputs=True`` marks a break that keeps its tensor arguments past the call (a cache
  storing a residual): it is handed owned copies of them at capture and at every replay, never
  the graph's memory, which the next replay rewrites.
* A call whose first breaks already ran (a replay that left its chain's path, see
  :mod:`accel.graphs.branches`) is run again under :func:`rerun`: those breaks return what they returned
  then, without running again, so their host effects (a step counter) happen once per call.

Marking lives in :mod:`accel.graphs.marks`, copy-back in :mod:`accel.graphs.copyback`, the
errors in :mod:`accel.graphs.errors`; this module records and replays, and exports them all.
It knows nothing of diffusers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import tree
from .copyback import PoolMap, copy_into, owned, views_of_pool_tensors
from .errors import BreakError, CopyBackError, NestedBreakError
from .marks import (
    ACTIVE,
    BreakKind,
    Memo,
    break_graph,
    check_decision,
    eager_on_graph,
    is_capturing,
    rerun,
    structure_key,
)

__all__ = [
    "BreakError",
    "BreakableCUDAGraph",
    "CopyBackError",
    "Memo",
    "NestedBreakError",
    "break_graph",
    "capture",
    "eager_on_graph",
    "end_capture_routing",
    "is_capturing",
    "rerun",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Graph and capture
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Break:
    """One eager break: the call to repeat at replay and the boundary buffer its output goes to.

    A decision has no buffer: ``value`` is what it returned at capture, the value the segments
    after it were recorded for. A keyed break has both: its buffer, and as ``value`` the
    structure key of its output at capture (:func:`~accel.graphs.marks.structure_key`).
    """

    fn: Callable[..., Any]
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    buffer: Any
    kind: BreakKind
    value: Any = None
    flat_buffer: tree.Flat = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.flat_buffer = tree.Flat(self.buffer)

    @property
    def decision(self) -> bool:
        return self.kind.decision

    def run(self) -> Any:
        """Run the function again on the recorded arguments; returns what it returned."""
        args, kwargs = self.args, self.kwargs
        if self.kind.keeps_inputs:
            args, kwargs = owned(args), owned(kwargs)
        if self.kind.inline_nested:
            token = ACTIVE.set(None)
            try:
                return self.fn(*args, **kwargs)
            finally:
                ACTIVE.reset(token)
        return self.fn(*args, **kwargs)

    def __call__(self) -> Any:
        """Run the break again: a decision returns its value; other breaks copy their output
        into the boundary buffer (and return None)."""
        out = self.run()
        if self.kind.decision:
            return check_decision(out, self.name)
        copy_into(self.flat_buffer, out, self.name)
        return None

    def memo_value(self) -> Any:
        """What this break returned in the replay that just ran it (its buffer holds it)."""
        return self.value if self.kind.decision else self.buffer

    def set_from(self, value: Any) -> None:
        """Take ``value`` as this break's output without running it (a re-run's memo)."""
        if not self.kind.decision and value is not self.buffer:
            copy_into(self.flat_buffer, value, self.name)


class BreakableCUDAGraph:
    """A captured region: ``len(segments) == len(breaks) + 1``.

    Filled by :func:`capture`; :meth:`replay` re-runs it. The object strongly holds every
    boundary buffer and every non-pool tensor its breaks read.
    """

    def __init__(self) -> None:
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def break_names(self) -> list[str]:
        return [b.name for b in self.breaks]

    @property
    def path(self) -> tuple[Any, ...]:
        """The values this capture's decisions took, in order (empty without decisions)."""
        return tuple(b.value for b in self.breaks if b.kind.decision or b.kind.keyed)

    def boundary_bytes(self) -> int:
        """Bytes held by boundary buffers (outside the pool)."""
        seen: dict[int, int] = {}
        for b in self.breaks:
            for t in b.flat_buffer.tensors:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def replay(self) -> None:
        """Replay every segment and run every break, in order, on the current stream.

        A decision that comes out otherwise than at capture raises :class:`CopyBackError`: the
        segments after it belong to the other value (:mod:`accel.graphs.branches` switches chains).
        """
        segments = self.segments
        for i, brk in enumerate(self.breaks):
            segments[i].replay()
            value = brk()
            if brk.kind.decision and value != brk.value:
                raise CopyBackError(f"decision {brk.name!r} came out {value!r}, captured for {brk.value!r}", value)
        segments[-1].replay()

    def reset(self) -> None:
        """Drop all segments and breaks (the pool keeps its blocks for later captures)."""
        self.segments.clear()
        self.breaks.clear()


def _reset_generator_capture_state() -> None:
    """Finish an empty capture after one that could not end.

    When the CUDA capture was invalidated (a sync slipped in), torch's capture_end raises before
    it tells the CUDA random generators that capture is over; every later random op on the
    device would then fail. Beginning and ending an empty capture resets them.
    """
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            g = torch.cuda.CUDAGraph()
            g.capture_begin()
            g.capture_end()
        del g


def _end_segment(seg: torch.cuda.CUDAGraph, pool: Any, device: torch.device) -> None:
    """End ``seg``'s capture; when that fails, still tell the allocator the capture into ``pool`` is over.

    Torch's ``capture_end`` (2.11 and earlier at least) raises on cudaStreamEndCapture's error
    before it ends the caching allocator's routing into the pool. Left so, the allocator counts a
    capture as under way for the rest of the process, and while it does, emptying the cache (and
    its own retry of a request that ran short) frees nothing of the default pool: after one
    invalidated capture the GPU suite's cache only grew, and later captures ran out of memory
    (docs/development.md, "The suite in one process"). Torch that ends the routing itself refuses the second
    end ("not currently recording"), which is ignored; captures never overlap (one capture
    session at a time), so no other capture's routing into this pool is ended.
    """
    try:
        seg.capture_end()
    except BaseException:
        end_capture_routing(pool, device)
        raise


def end_capture_routing(pool: Any, device: torch.device) -> None:
    """End the caching allocator's routing of a capture's allocations into ``pool``; call after a
    capture into it failed (see :func:`_end_segment`: torch may have left it on). Harmless when
    torch ended it already; never call while a capture into ``pool`` is under way."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(Exception):  # already ended, or never begun
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)


class _Capture:
    capturing = True

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        pool: Any,
        error_mode: str,
        device: torch.device,
        memo: Memo | None = None,
        watch: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.graph = graph
        self.watch = watch
        self.pool = pool
        self.error_mode = error_mode
        self.device = device
        self.pool_map = PoolMap(pool, device)
        self.open_segment: torch.cuda.CUDAGraph | None = None
        self.in_break = False
        self.memo = memo

    def open(self) -> None:
        seg = torch.cuda.CUDAGraph()
        try:
            seg.capture_begin(pool=self.pool, capture_error_mode=self.error_mode)
        except BaseException:
            end_capture_routing(self.pool, self.device)  # torch routes to the pool before it begins the CUDA capture
            raise
        self.open_segment = seg

    def close(self) -> None:
        seg, self.open_segment = self.open_segment, None
        if seg is None:
            return
        with warnings.catch_warnings():
            # A break at the very start or end leaves an empty segment; replaying it is harmless.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            _end_segment(seg, self.pool, self.device)
        self.graph.segments.append(seg)

    def abort(self) -> None:
        seg, self.open_segment = self.open_segment, None
        if seg is None:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _end_segment(seg, self.pool, self.device)
        except Exception:
            _reset_generator_capture_state()

    def run_break(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kind: BreakKind
    ) -> Any:
        if self.in_break:
            raise NestedBreakError(
                f"{name!r} is marked eager_on_graph and was called from inside another eager break; "
                "breaks cannot nest. Mark only the outer function, or pass inline_nested=True to it."
            )
        self.close()
        if self.graph.segments:
            # Run what was just recorded, so the break computes from real inputs rather than
            # from whatever the pool held: a Python constant it returns (a mask check's bool)
            # steers how the next segment is recorded.
            self.graph.segments[-1].replay()
        if self.memo is not None and self.memo.pending:
            # The call being captured already ran this break: its value, not a second run.
            out = self.memo.take(name)
            if not kind.decision:
                out = tree.clone(out)  # this chain's own boundary buffer, outside the pool
        else:
            with self.watch(f"break {name!r}") if self.watch is not None else contextlib.nullcontext():
                out = self._run(fn, args, kwargs, kind)
        value = check_decision(out, name) if kind.decision else structure_key(out) if kind.keyed else None
        self.graph.breaks.append(
            _Break(
                fn=fn,
                name=name,
                args=views_of_pool_tensors(args, self.pool_map),
                kwargs=views_of_pool_tensors(kwargs, self.pool_map),
                buffer=None if kind.decision else out,
                kind=kind,
                value=value,
            )
        )
        self.open()
        return out

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], kind: BreakKind) -> Any:
        if kind.keeps_inputs:
            args, kwargs = owned(args), owned(kwargs)
        self.in_break = True
        token = ACTIVE.set(None) if kind.inline_nested else None
        try:
            return fn(*args, **kwargs)
        finally:
            if token is not None:
                ACTIVE.reset(token)
            self.in_break = False


@contextlib.contextmanager
def capture(
    graph: BreakableCUDAGraph,
    *,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "thread_local",
    memo: Memo | None = None,
    watch: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
) -> Iterator[BreakableCUDAGraph]:
    """Capture the code in the ``with`` block into ``graph`` as segments and breaks.

    ``pool`` is a :func:`torch.cuda.graph_pool_handle` shared by every segment (and by other
    graphs that should share memory); ``None`` makes one for this graph. ``stream`` is the
    capture stream (a fresh side stream if omitted; capture is illegal on the default stream).
    The caller warms the code up eagerly first and freezes the garbage collector around a
    capture session. ``memo``: the call being captured already ran its first breaks (see
    :func:`rerun`); they take their values from it. ``watch(what)``: entered around every break's
    run (what the caller must see no break do: :mod:`accel.graphs.stores`). On error the graph is
    reset and the error propagates.
    """
    if is_capturing():
        raise BreakError("a breakable capture is already active in this thread")
    if graph.segments:
        raise BreakError("this BreakableCUDAGraph already holds a capture; call reset() first")
    stream = stream if stream is not None else torch.cuda.Stream()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    cap = _Capture(graph, pool, capture_error_mode, stream.device, memo.fresh() if memo is not None else None, watch)
    with torch.cuda.stream(stream), _run_capture(cap):
        yield graph


@contextlib.contextmanager
def _run_capture(cap: _Capture) -> Iterator[None]:
    """Make ``cap`` the thread's capture: open its first segment, run the block, close its last.

    On any error the open segment is abandoned, the graph reset, and the error propagates.
    """
    token = ACTIVE.set(cap)
    try:
        cap.open()
        yield
        cap.close()
    except BaseException:
        cap.abort()
        cap.graph.reset()
        raise
    finally:
        ACTIVE.reset(token)
