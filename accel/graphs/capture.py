"""One capture of a call signature's decision path, its check against eager, and the gc session around captures.

A :class:`Target` is what a capture runs: a runner's callable and what surrounds it when the
capture begins (its pool, scope and step state). :func:`attempt` warms the call up on the
pool's capture stream and captures it into a new :class:`~accel.graphs.branches.Chain`, or
raises (nothing is kept). :func:`verify` compares one replay of that chain with an eager run of
the same inputs, bit for bit. Both leave the state a call's breaks keep across calls
(:class:`~accel.graphs.entries.StepState`) as it was, so a capture has the effect of exactly one
call. :func:`capture_session` keeps the garbage collector off while graphs are captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import bcg, tree
from .branches import Chain, GraphTree
from .config import RunnerConfig
from .entries import Entry, StepState
from .errors import BreakError

if TYPE_CHECKING:
    from .pool import GraphPool

__all__ = ["CaptureScope", "Target", "attempt", "capture_session", "verify"]

CaptureScope = Callable[[], contextlib.AbstractContextManager[list]]


@dataclasses.dataclass(frozen=True)
class Target:
    """What a capture runs, taken from its runner when the capture begins.

    Attributes:
        fn: the callable captured.
        name: for messages.
        config: the runner's settings.
        pool: where the graphs go.
        scope: entered around warm-up and capture; what it yields lives as long as the graph.
        state: what the call's breaks keep across calls, put back after each run of a capture.
        wraps: the callable ``fn`` stands for, where ``fn`` wraps it (never marked as a break).
    """

    fn: Callable[..., Any]
    name: str
    config: RunnerConfig
    pool: GraphPool
    scope: CaptureScope | None = None
    state: StepState | None = None
    wraps: Callable[..., Any] | None = None


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


@contextlib.contextmanager
def _as_one_call(state: StepState | None) -> Iterator[Callable[[], None]]:
    """Around a capture's runs: yields a function that puts ``state`` back as it was when the
    block began (called after each run); the block leaves it so too."""
    if state is None:
        yield lambda: None
        return
    snapshot = state.snapshot()
    try:
        yield lambda: state.restore(snapshot)
    finally:
        state.restore(snapshot)


def _items(container: list | dict) -> tuple[Any, ...]:
    """What a list or dict holds, by identity (keys too, for a dict)."""
    if isinstance(container, dict):
        return tuple((k, id(v)) for k, v in container.items())
    return tuple(id(v) for v in container)


def _container_contents(tree: Any, path: str = "") -> list[tuple[str, Any, tuple[Any, ...]]]:
    """(path, container, :func:`_items`) for every list and dict in ``tree``."""
    out: list[tuple[str, Any, tuple[Any, ...]]] = []
    if isinstance(tree, (list, dict)):
        out.append((path, tree, _items(tree)))
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _container_contents(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out += _container_contents(v, f"{path}[{i}]")
    return out


def _check_containers_unchanged(name: str, before: list[tuple[str, Any, tuple[Any, ...]]]) -> None:
    """BreakError where the call stored into a list or dict it was given: a replay runs no Python,
    so the caller's container would keep what it held (a causal VAE's per-frame feature cache
    would stay empty, and every frame decode as the first)."""
    for path, container, items in before:
        if _items(container) != items:
            where = "args" + path[3:] if path.startswith("[0]") else "kwargs" + path[3:]
            raise BreakError(
                f"{name}: the call stores into a container it is given ({where}), which a replay would not: "
                "it cannot be captured"
            )


def attempt(
    target: Target,
    entry: Entry,
    memo: bcg.Memo | None,
    *,
    check_budget: Callable[[bcg.BreakableCUDAGraph], None],
    verified: bool,
) -> Chain:
    """One warm-up and capture of a path of ``entry``'s signature (the first if ``memo`` is
    None); raises on any failure (nothing kept). ``check_budget`` raises when the new graph
    would not fit; ``verified``: the chain must equal an eager run (:func:`verify`)."""
    fn, name, config, pool = target.fn, target.name, target.config, target.pool
    sig, static_inputs = entry.signature, entry.static_inputs
    captured = fn
    if config.debug:
        captured = bcg.eager_on_graph(fn, name=f"{name} (debug: whole call eager)", inline_nested=True)
    t0 = time.perf_counter()
    graph = bcg.BreakableCUDAGraph()
    try:
        with torch.inference_mode(False), torch.no_grad(), _as_one_call(target.state) as restore:
            opened = target.scope() if target.scope is not None else contextlib.nullcontext([])
            with pool.lock, opened as keepalive:
                caller = torch.cuda.current_stream(pool.device)
                pool.stream.wait_stream(caller)
                # Fresh containers for every run: a callee that fills a list it is given
                # (a causal VAE's feature cache) must find it as the caller built it.
                with torch.cuda.stream(pool.stream):
                    for _ in range(config.warmup_runs):
                        args, kwargs = sig.rebuild(static_inputs)
                        before = _container_contents((args, kwargs))
                        with bcg.rerun(memo):
                            fn(*args, **kwargs)
                        restore()
                        _check_containers_unchanged(name, before)
                pool.stream.synchronize()
                pool.make_room()
                args, kwargs = sig.rebuild(static_inputs)
                with bcg.capture(graph, pool=pool.handle_for(graph), stream=pool.stream, memo=memo):
                    output = captured(*args, **kwargs)
                caller.wait_stream(pool.stream)
                pool.stream.synchronize()
                restore()
            if graph.num_segments > config.max_segments:
                raise BreakError(f"{graph.num_segments} segments exceed max_segments={config.max_segments}")
            check_budget(graph)
            chain = Chain(graph, output, list(keepalive), time.perf_counter() - t0)
            if verified:
                verify(fn, name, pool, entry, chain, memo, restore)
        return chain
    except BaseException:
        graph.reset()
        raise


def verify(
    fn: Callable[..., Any],
    name: str,
    pool: GraphPool,
    entry: Entry,
    chain: Chain,
    memo: bcg.Memo | None,
    restore: Callable[[], None],
) -> None:
    """Raise unless one replay of ``chain`` equals an eager run of the same inputs bit for bit.

    Breaks found automatically are only as safe as the function's purity, which nothing can
    prove from outside; this comparison is the evidence, for the warmed inputs.
    """
    args, kwargs = entry.signature.rebuild(entry.static_inputs)
    with torch.inference_mode(False), torch.no_grad():
        with bcg.rerun(memo):
            expected = tree.clone(fn(*args, **kwargs))
        restore()
        trial = GraphTree()
        trial.add(chain)
        got = entry.replay(pool, trial, None, memo)
        restore()
    want, have = tree.tensors(expected), tree.tensors(got)
    same = len(want) == len(have) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, have)
    )
    if not same:
        raise BreakError(f"{name}: the graph's output differs from an eager run of the same inputs")
