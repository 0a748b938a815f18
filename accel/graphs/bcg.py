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

This module knows nothing of diffusers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from . import tree

__all__ = [
    "BreakError",
    "BreakableCUDAGraph",
    "CopyBackError",
    "Memo",
    "NestedBreakError",
    "break_graph",
    "capture",
    "eager_on_graph",
    "is_capturing",
    "rerun",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class BreakError(RuntimeError):
    """Base class of the errors raised by the breakable-graph core."""


class NestedBreakError(BreakError):
    """A marked function was called while another marked function was running as a break."""


class CopyBackError(BreakError):
    """A break's replay output does not match the boundary buffer recorded at capture.

    ``output`` is what the break returned, for a caller that finishes the call another way.
    """

    def __init__(self, message: str, output: Any = None) -> None:
        super().__init__(message)
        self.output = output


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How a marked function behaves as a break."""

    inline_nested: bool = False
    decision: bool = False
    keeps_inputs: bool = False


# What this thread's marked functions answer to: an open capture, a re-run, or nothing (plain calls).
_ACTIVE: contextvars.ContextVar[_Capture | _Rerun | None] = contextvars.ContextVar("bcg_active_capture", default=None)


def is_capturing() -> bool:
    """True while a breakable capture is active in this thread (also while a break runs in it)."""
    return isinstance(_ACTIVE.get(), _Capture)


def eager_on_graph(
    fn: F | None = None,
    *,
    name: str | None = None,
    inline_nested: bool = False,
    decision: bool = False,
    keeps_inputs: bool = False,
) -> Any:
    """Mark ``fn`` as an eager break.

    Usable as ``@eager_on_graph`` or ``@eager_on_graph(name="...")``. Outside a capture the
    wrapper is ``fn`` itself (one context-variable lookup more). ``inline_nested=True`` lets
    marked functions called from inside ``fn`` run as plain calls instead of raising
    :class:`NestedBreakError`; the debug mode uses it to run a whole forward as one break.
    ``decision=True``: ``fn`` returns a small host value that picks the continuation (see the
    module's contract). ``keeps_inputs=True``: ``fn`` keeps its tensor arguments, so under a
    capture it gets owned copies of them.
    """
    kind = _Kind(inline_nested, decision, keeps_inputs)

    def decorate(f: F) -> F:
        label = name or getattr(f, "__qualname__", None) or repr(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cap = _ACTIVE.get()
            if cap is None:
                return f(*args, **kwargs)
            return cap.run_break(f, label, args, kwargs, kind)

        wrapper.__bcg_eager__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


_DECISION_TYPES = (bool, int, str, type(None))


def check_decision(value: Any, name: str) -> Any:
    """``value`` if it can be a decision (a small hashable host value), else BreakError naming the break."""
    if isinstance(value, _DECISION_TYPES) or (
        isinstance(value, tuple) and all(isinstance(v, _DECISION_TYPES) for v in value)
    ):
        return value
    raise BreakError(
        f"decision {name!r} returned a {type(value).__name__}; a decision returns a bool, an int, a string, "
        "None, or a tuple of those"
    )


class Memo:
    """What the first breaks of a call returned, in order, for running the call again.

    ``entries`` is a list of ``(name, value)``; :meth:`take` hands them out in order and checks
    that the same break asks for each (the code took another way otherwise, and nothing of the
    rest could be trusted).
    """

    def __init__(self, entries: list[tuple[str, Any]]) -> None:
        self.entries = list(entries)
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def fresh(self) -> Memo:
        """The same entries, handed out from the start again."""
        return Memo(self.entries)

    @property
    def pending(self) -> bool:
        return self._next < len(self.entries)

    def take(self, name: str) -> Any:
        want, value = self.entries[self._next]
        if want != name:
            raise BreakError(
                f"running a call again reached break {name!r} where the first run had {want!r} "
                f"(break {self._next}): the call is not deterministic"
            )
        self._next += 1
        return value


class _Rerun:
    """Marked functions during a call run again outside any capture: the memo's breaks return
    their recorded values, later ones run as plain calls."""

    def __init__(self, memo: Memo) -> None:
        self.memo = memo

    def run_break(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kind: _Kind
    ) -> Any:
        if self.memo.pending:
            return self.memo.take(name)
        return fn(*args, **kwargs)


@contextlib.contextmanager
def rerun(memo: Memo | None) -> Iterator[None]:
    """Run a call again whose first breaks already ran: each of them returns its value from
    ``memo`` instead of running (see the module's contract). ``None``: nothing to skip."""
    if memo is None or not len(memo):
        yield
        return
    token = _ACTIVE.set(_Rerun(memo.fresh()))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@eager_on_graph(name="break_graph")
def _empty_break() -> None:
    return None


def break_graph() -> None:
    """Force a segment boundary here (a no-op outside a capture)."""
    _empty_break()


# --------------------------------------------------------------------------------------------
# Copy-back
# --------------------------------------------------------------------------------------------
def _same_constant(captured: Any, replayed: Any) -> bool:
    if captured is replayed:
        return True
    try:
        return bool(captured == replayed)
    except Exception:  # e.g. an array's elementwise ==: not a constant we can vouch for
        return False


def _leaf_mismatch(captured: Any, replayed: Any) -> str | None:
    """Why ``replayed`` cannot be copied into the captured leaf, or None if it can."""
    if isinstance(captured, torch.Tensor):
        if not isinstance(replayed, torch.Tensor):
            return f"expected a tensor, got {type(replayed).__name__}"
        if replayed.shape != captured.shape or replayed.dtype != captured.dtype or replayed.device != captured.device:
            return (
                f"captured {tuple(captured.shape)} {captured.dtype} on {captured.device}, "
                f"replay gave {tuple(replayed.shape)} {replayed.dtype} on {replayed.device}"
            )
        return None
    if type(replayed) is not type(captured):
        return f"captured a {type(captured).__name__}, replay gave a {type(replayed).__name__}"
    # A constant: the segments after this break were recorded with the captured value baked in.
    if not _same_constant(captured, replayed):
        return f"constant changed from {captured!r} to {replayed!r}"
    return None


def _structure_mismatch(dst: tree.Flat, leaves: list[Any], spec: tree.TreeSpec, root: str) -> str:
    """``path: why`` for the first place where a replay output's structure left the buffer's."""
    for step in tree.align(dst.spec, spec, root):
        if step.leaves:
            continue
        captured = dst.leaves[step.a_leaf] if step.a.is_leaf() else None
        if step.a.is_leaf() and isinstance(captured, torch.Tensor):
            got = type(leaves[step.b_leaf]).__name__ if step.b.is_leaf() else tree.type_name(step.b)
            return f"{step.path}: expected a tensor, got {got}"
        if step.a.is_leaf() or step.b.is_leaf() or tree.node_type(step.a) is not tree.node_type(step.b):
            was = type(captured).__name__ if step.a.is_leaf() else tree.type_name(step.a)
            now = type(leaves[step.b_leaf]).__name__ if step.b.is_leaf() else tree.type_name(step.b)
            return f"{step.path}: captured a {was}, replay gave a {now}"
        return f"{step.path}: {tree.describe_change(step.a, step.b)}"
    return f"{root}: structure changed"  # unreachable while align and spec_key agree


def _copy_into(dst: tree.Flat, src: Any, break_name: str, root: str = "output") -> None:
    """Copy ``src`` into the flattened boundary buffer ``dst`` in place; strict (see the contract).

    Replay calls this once per break: the buffer was flattened at capture, only ``src`` is walked.
    """
    if dst.key is None and isinstance(src, torch.Tensor):
        leaves = [src]  # a bare leaf captured, a tensor back (the common case): no spec to build
    else:
        leaves, key = tree.flatten_key(src)
        if key != dst.key:
            why = _structure_mismatch(dst, leaves, tree.flatten(src)[1], root)
            raise CopyBackError(f"break {break_name!r}: {why}", src)
    for i, (d, s) in enumerate(zip(dst.leaves, leaves)):
        why = _leaf_mismatch(d, s)
        if why is not None:
            raise CopyBackError(f"break {break_name!r}: {root}{tree.leaf_paths(dst.spec)[i]}: {why}", src)
        if isinstance(d, torch.Tensor) and (s.data_ptr() != d.data_ptr() or s.stride() != d.stride()):
            d.copy_(s)


def copy_back(dst: Any, src: Any, break_name: str, path: str = "output") -> None:
    """Copy ``src`` into ``dst`` in place, raising :class:`CopyBackError` on any mismatch.

    The message names the break and the field, e.g. ``break 'x': output[1]['pair'][0]: ...``.
    """
    _copy_into(tree.Flat(dst), src, break_name, path)


# --------------------------------------------------------------------------------------------
# Weak views of pool-resident break inputs
# --------------------------------------------------------------------------------------------
class _PoolMap:
    """Which device addresses belong to one graph pool, from the caching allocator's snapshot.

    A break's inputs that a segment produced live in the graph pool. Holding them strongly would
    pin one activation per break and make graph memory grow with the number of breaks; a
    non-owning view of the same address is enough, because within a replay the producing segment
    writes it right before the break reads it, and every other writer of pool memory is a replay
    of some graph, which never runs concurrently with this one.
    """

    def __init__(self, pool: Any, device: torch.device) -> None:
        self.pool = tuple(pool) if pool is not None else None
        self.device = device
        self.ranges: list[tuple[int, int, bool]] = []

    def _refresh(self) -> None:
        segments = torch.cuda.memory._snapshot(self.device)["segments"]  # type: ignore[attr-defined]
        self.ranges = [
            (s["address"], s["address"] + s["total_size"], tuple(s.get("segment_pool_id", ())) == self.pool)
            for s in segments
            if s.get("device", self.device.index) == self.device.index
        ]

    def owns(self, t: torch.Tensor) -> bool:
        if self.pool is None or t.device.type != "cuda" or t.untyped_storage().nbytes() == 0:
            return False
        ptr = t.untyped_storage().data_ptr()
        for attempt in range(2):
            for lo, hi, in_pool in self.ranges:
                if lo <= ptr < hi:
                    return in_pool
            if attempt == 0:
                self._refresh()
        return False


def _weak_view(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(alias, t.storage_offset(), t.size(), t.stride())
    return out


def _views_of_pool_tensors(obj: Any, pool_map: _PoolMap) -> Any:
    """``obj`` with every tensor the graph pool owns replaced by a non-owning view of it.

    Walks ``obj`` as arguments are walked (:mod:`accel.graphs.tree`): containers, namedtuples and
    dataclasses are rebuilt around the views; plain objects are passed on as they are, so a
    tensor inside one stays strongly held. ``obj`` itself comes back when nothing was replaced.
    """
    leaves, spec = tree.flatten(obj, into_objects=False)
    views = [_weak_view(x) if type(x) is torch.Tensor and pool_map.owns(x) else x for x in leaves]
    if all(v is x for v, x in zip(views, leaves)):
        return obj
    return tree.unflatten(views, spec)


# --------------------------------------------------------------------------------------------
# Graph and capture
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Break:
    """One eager break: the call to repeat at replay and the boundary buffer its output goes to.

    A decision has no buffer: ``value`` is what it returned at capture, the value the segments
    after it were recorded for.
    """

    fn: Callable[..., Any]
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    buffer: Any
    kind: _Kind
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
            args, kwargs = _owned(args), _owned(kwargs)
        if self.kind.inline_nested:
            token = _ACTIVE.set(None)
            try:
                return self.fn(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)
        return self.fn(*args, **kwargs)

    def __call__(self) -> Any:
        """Run the break again: a decision returns its value; other breaks copy their output
        into the boundary buffer (and return None)."""
        out = self.run()
        if self.kind.decision:
            return check_decision(out, self.name)
        _copy_into(self.flat_buffer, out, self.name)
        return None

    def memo_value(self) -> Any:
        """What this break returned in the replay that just ran it (its buffer holds it)."""
        return self.value if self.kind.decision else self.buffer

    def set_from(self, value: Any) -> None:
        """Take ``value`` as this break's output without running it (a re-run's memo)."""
        if not self.kind.decision and value is not self.buffer:
            _copy_into(self.flat_buffer, value, self.name)


def _owned(obj: Any) -> Any:
    """``obj`` with every tensor cloned (a break that keeps its inputs must not keep graph memory)."""
    return tree.map_tensors(lambda t: t.clone(), obj, into_objects=False)


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
        return tuple(b.value for b in self.breaks if b.kind.decision)

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


class _Capture:
    def __init__(
        self, graph: BreakableCUDAGraph, pool: Any, error_mode: str, device: torch.device, memo: Memo | None = None
    ) -> None:
        self.graph = graph
        self.pool = pool
        self.error_mode = error_mode
        self.pool_map = _PoolMap(pool, device)
        self.open_segment: torch.cuda.CUDAGraph | None = None
        self.in_break = False
        self.memo = memo

    def open(self) -> None:
        seg = torch.cuda.CUDAGraph()
        seg.capture_begin(pool=self.pool, capture_error_mode=self.error_mode)
        self.open_segment = seg

    def close(self) -> None:
        seg, self.open_segment = self.open_segment, None
        if seg is None:
            return
        with warnings.catch_warnings():
            # A break at the very start or end leaves an empty segment; replaying it is harmless.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            seg.capture_end()
        self.graph.segments.append(seg)

    def abort(self) -> None:
        seg, self.open_segment = self.open_segment, None
        if seg is None:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                seg.capture_end()
        except Exception:
            _reset_generator_capture_state()

    def run_break(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kind: _Kind
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
            out = self._run(fn, args, kwargs, kind)
        value = check_decision(out, name) if kind.decision else None
        self.graph.breaks.append(
            _Break(
                fn=fn,
                name=name,
                args=_views_of_pool_tensors(args, self.pool_map),
                kwargs=_views_of_pool_tensors(kwargs, self.pool_map),
                buffer=None if kind.decision else out,
                kind=kind,
                value=value,
            )
        )
        self.open()
        return out

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], kind: _Kind) -> Any:
        if kind.keeps_inputs:
            args, kwargs = _owned(args), _owned(kwargs)
        self.in_break = True
        token = _ACTIVE.set(None) if kind.inline_nested else None
        try:
            return fn(*args, **kwargs)
        finally:
            if token is not None:
                _ACTIVE.reset(token)
            self.in_break = False


@contextlib.contextmanager
def capture(
    graph: BreakableCUDAGraph,
    *,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "thread_local",
    memo: Memo | None = None,
) -> Iterator[BreakableCUDAGraph]:
    """Capture the code in the ``with`` block into ``graph`` as segments and breaks.

    ``pool`` is a :func:`torch.cuda.graph_pool_handle` shared by every segment (and by other
    graphs that should share memory); ``None`` makes one for this graph. ``stream`` is the
    capture stream (a fresh side stream if omitted; capture is illegal on the default stream).
    The caller warms the code up eagerly first and freezes the garbage collector around a
    capture session. ``memo``: the call being captured already ran its first breaks (see
    :func:`rerun`); they take their values from it. On error the graph is reset and the error
    propagates.
    """
    if isinstance(_ACTIVE.get(), _Capture):
        raise BreakError("a breakable capture is already active in this thread")
    if graph.segments:
        raise BreakError("this BreakableCUDAGraph already holds a capture; call reset() first")
    stream = stream if stream is not None else torch.cuda.Stream()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    cap = _Capture(graph, pool, capture_error_mode, stream.device, memo.fresh() if memo is not None else None)
    with torch.cuda.stream(stream), _run_capture(cap):
        yield graph


@contextlib.contextmanager
def _run_capture(cap: _Capture) -> Iterator[None]:
    """Make ``cap`` the thread's capture: open its first segment, run the block, close its last.

    On any error the open segment is abandoned, the graph reset, and the error propagates.
    """
    token = _ACTIVE.set(cap)
    try:
        cap.open()
        yield
        cap.close()
    except BaseException:
        cap.abort()
        cap.graph.reset()
        raise
    finally:
        _ACTIVE.reset(token)
