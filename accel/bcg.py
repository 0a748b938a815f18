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
  :class:`CopyBackError` naming the break and the field.
* Replay is a flat walk over segments and breaks on the current stream, with no host sync.
* Segments are recorded, not run, during capture: a break then sees stale inputs. Never use the
  capture pass's output; replay to get real values.

This module knows nothing of diffusers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import warnings
from typing import Any, Callable, Iterator, TypeVar

import torch

__all__ = [
    "BreakError",
    "BreakableCUDAGraph",
    "CopyBackError",
    "NestedBreakError",
    "break_graph",
    "capture",
    "eager_on_graph",
    "is_capturing",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class BreakError(RuntimeError):
    """Base class of the errors raised by the breakable-graph core."""


class NestedBreakError(BreakError):
    """A marked function was called while another marked function was running as a break."""


class CopyBackError(BreakError):
    """A break's replay output does not match the boundary buffer recorded at capture."""


_ACTIVE: contextvars.ContextVar["_Capture | None"] = contextvars.ContextVar("bcg_active_capture", default=None)


def is_capturing() -> bool:
    """True while a breakable capture is active in this thread (also while a break runs in it)."""
    return _ACTIVE.get() is not None


def eager_on_graph(fn: F | None = None, *, name: str | None = None, inline_nested: bool = False) -> Any:
    """Mark ``fn`` as an eager break.

    Usable as ``@eager_on_graph`` or ``@eager_on_graph(name="...")``. Outside a capture the
    wrapper is ``fn`` itself (one context-variable lookup more). ``inline_nested=True`` lets
    marked functions called from inside ``fn`` run as plain calls instead of raising
    :class:`NestedBreakError`; the debug mode uses it to run a whole forward as one break.
    """

    def decorate(f: F) -> F:
        label = name or getattr(f, "__qualname__", None) or repr(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cap = _ACTIVE.get()
            if cap is None:
                return f(*args, **kwargs)
            return cap.run_break(f, label, args, kwargs, inline_nested)

        wrapper.__bcg_eager__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


@eager_on_graph(name="break_graph")
def _split() -> None:
    return None


def break_graph() -> None:
    """Force a segment boundary here (a no-op outside a capture)."""
    _split()


# --------------------------------------------------------------------------------------------
# Copy-back
# --------------------------------------------------------------------------------------------
def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def copy_back(dst: Any, src: Any, where: str, path: str = "output") -> None:
    """Copy ``src`` into ``dst`` in place, raising :class:`CopyBackError` on any mismatch."""

    def fail(why: str) -> None:
        raise CopyBackError(f"break {where!r}: {path}: {why}")

    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor):
            fail(f"expected a tensor, got {type(src).__name__}")
        if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device:
            fail(
                f"captured {tuple(dst.shape)} {dst.dtype} on {dst.device}, "
                f"replay gave {tuple(src.shape)} {src.dtype} on {src.device}"
            )
        if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
            dst.copy_(src)
        return
    if type(src) is not type(dst):
        fail(f"captured a {type(dst).__name__}, replay gave a {type(src).__name__}")
    if isinstance(dst, dict):
        if list(dst.keys()) != list(src.keys()):
            fail(f"keys changed from {list(dst.keys())} to {list(src.keys())}")
        for k in dst:
            copy_back(dst[k], src[k], where, f"{path}[{k!r}]")
        return
    if isinstance(dst, (list, tuple)):
        if len(dst) != len(src):
            fail(f"length changed from {len(dst)} to {len(src)}")
        for i, (d, s) in enumerate(zip(dst, src)):
            copy_back(d, s, where, f"{path}[{i}]")
        return
    if _is_dataclass_instance(dst):
        for f in dataclasses.fields(dst):
            copy_back(getattr(dst, f.name), getattr(src, f.name), where, f"{path}.{f.name}")
        return
    if hasattr(dst, "__dict__") and not callable(dst):
        if set(vars(dst)) != set(vars(src)):
            fail(f"attributes changed from {sorted(vars(dst))} to {sorted(vars(src))}")
        for k, v in vars(dst).items():
            copy_back(v, vars(src)[k], where, f"{path}.{k}")
        return
    # A constant: the segments after this break were recorded with the captured value baked in.
    if dst is not src and dst != src:
        fail(f"constant changed from {dst!r} to {src!r}")


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


def _weaken(obj: Any, pool_map: _PoolMap) -> Any:
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor and pool_map.owns(obj):
            return _weak_view(obj)
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_weaken(o, pool_map) for o in obj)
    if type(obj) is dict:
        return {k: _weaken(v, pool_map) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------------
# Graph and capture
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Break:
    fn: Callable[..., Any]
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    buffer: Any
    inline_nested: bool

    def __call__(self) -> None:
        if self.inline_nested:
            token = _ACTIVE.set(None)
            try:
                out = self.fn(*self.args, **self.kwargs)
            finally:
                _ACTIVE.reset(token)
        else:
            out = self.fn(*self.args, **self.kwargs)
        copy_back(self.buffer, out, self.name)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif hasattr(obj, "__dict__") and not callable(obj):
        for v in vars(obj).values():
            yield from _tensors(v)


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

    def boundary_bytes(self) -> int:
        """Bytes held by boundary buffers (outside the pool)."""
        seen: dict[int, int] = {}
        for b in self.breaks:
            for t in _tensors(b.buffer):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def replay(self) -> None:
        """Replay every segment and run every break, in order, on the current stream."""
        segments = self.segments
        for i, brk in enumerate(self.breaks):
            segments[i].replay()
            brk()
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
    def __init__(self, graph: BreakableCUDAGraph, pool: Any, error_mode: str, device: torch.device) -> None:
        self.graph = graph
        self.pool = pool
        self.error_mode = error_mode
        self.pool_map = _PoolMap(pool, device)
        self.open_segment: torch.cuda.CUDAGraph | None = None
        self.in_break = False

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
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inline_nested: bool
    ) -> Any:
        if self.in_break:
            raise NestedBreakError(
                f"{name!r} is marked eager_on_graph and was called from inside another eager break; "
                "breaks cannot nest. Mark only the outer function, or pass inline_nested=True to it."
            )
        self.close()
        self.in_break = True
        token = _ACTIVE.set(None) if inline_nested else None
        try:
            out = fn(*args, **kwargs)
        finally:
            if token is not None:
                _ACTIVE.reset(token)
            self.in_break = False
        self.graph.breaks.append(
            _Break(
                fn=fn,
                name=name,
                args=_weaken(args, self.pool_map),
                kwargs=_weaken(kwargs, self.pool_map),
                buffer=out,
                inline_nested=inline_nested,
            )
        )
        self.open()
        return out


@contextlib.contextmanager
def capture(
    graph: BreakableCUDAGraph,
    *,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "thread_local",
) -> Iterator[BreakableCUDAGraph]:
    """Capture the code in the ``with`` block into ``graph`` as segments and breaks.

    ``pool`` is a :func:`torch.cuda.graph_pool_handle` shared by every segment (and by other
    graphs that should share memory); ``None`` makes one for this graph. ``stream`` is the
    capture stream (a fresh side stream if omitted; capture is illegal on the default stream).
    The caller warms the code up eagerly first and freezes the garbage collector around a
    capture session. On error the graph is reset and the error propagates.
    """
    if _ACTIVE.get() is not None:
        raise BreakError("a breakable capture is already active in this thread")
    if graph.segments:
        raise BreakError("this BreakableCUDAGraph already holds a capture; call reset() first")
    stream = stream if stream is not None else torch.cuda.Stream()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    cap = _Capture(graph, pool, capture_error_mode, stream.device)
    with torch.cuda.stream(stream), _active(cap):
        yield graph


@contextlib.contextmanager
def _active(cap: _Capture) -> Iterator[None]:
    """Make ``cap`` the thread's capture between its first and last segment."""
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
