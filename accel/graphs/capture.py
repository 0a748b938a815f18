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

from . import bcg, containers, stores, tree
from .branches import Chain, GraphTree
from .config import RunnerConfig
from .copyback import PoolMap
from .entries import Entry, StepState
from .errors import BreakError
from .signature import LITERALS

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


def attempt(
    target: Target,
    entry: Entry,
    memo: bcg.Memo | None,
    *,
    check_budget: Callable[[bcg.BreakableCUDAGraph], None],
    verified: bool,
) -> Chain:
    """One warm-up and capture of a path of ``entry``'s signature (the first if ``memo`` is
    None); raises on any failure (nothing kept). ``check_budget`` raises when the new graph would not
    fit; ``verified``: the chain must equal an eager run (:func:`verify`)."""
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
                # Fresh containers for every run (rebuilt from the signature): a callee that fills
                # a list it is given (a causal VAE's feature cache) finds it as the caller built it.
                warm: stores.Recording | None = None
                # The warm-up runs are the eager call the graph replaces: their transient peak is measured.
                versions = [static_inputs[i]._version for i in sorted(entry.state_inputs)]
                with torch.cuda.stream(pool.stream), pool.measure_eager():
                    for _ in range(config.warmup_runs):
                        args, kwargs = sig.rebuild(static_inputs)
                        given = containers.Given(args, kwargs, sig.state)
                        with bcg.rerun(memo):
                            out = fn(*args, **kwargs)
                        restore()
                        warm = stores.record(given, name, static_inputs, sig.objects, out, pool.device).released()
                        del args, kwargs, given, out  # what the run stored is not kept through the capture
                pool.stream.synchronize()
                pool.make_room()
                args, kwargs = sig.rebuild(static_inputs)
                given = containers.Given(args, kwargs, sig.state)
                watch = given.unchanged_by if given.found else None
                handle = pool.handle_for(graph)
                with bcg.capture(graph, pool=handle, stream=pool.stream, memo=memo, watch=watch):
                    output = captured(*args, **kwargs)
                done = stores.record(given, name, static_inputs, sig.objects, output, pool.device)
                done.check_against(warm, name)
                _check_state_unwritten(entry, versions, name)
                kept = stores.Stores(done, PoolMap(handle, pool.device)) if done.stored else None
                del args, kwargs, given, done
                caller.wait_stream(pool.stream)
                pool.stream.synchronize()
                restore()
            if graph.num_segments > config.max_segments:
                raise BreakError(f"{graph.num_segments} segments exceed max_segments={config.max_segments}")
            check_budget(graph)
            chain = Chain(graph, output, list(keepalive), time.perf_counter() - t0, stores=kept)
            if verified:
                verify(fn, name, pool, entry, chain, memo, restore)
        return chain
    except BaseException:
        graph.reset()
        raise


def _check_state_unwritten(entry: Entry, versions: list[int], name: str) -> None:
    """BreakError if the call wrote in place into a tensor of a state object it was given (its
    version counter moved since ``versions``): a replay writes the graph's static copy, not the
    caller's tensor, and the entry's replays copy such tensors in only when they changed."""
    for i, was in zip(sorted(entry.state_inputs), versions):
        if entry.static_inputs[i]._version != was:
            raise BreakError(
                f"{name}: the call writes in place into {entry.signature.field(i)}, a tensor of a state object it is "
                "given: a replay would write the graph's copy, not the caller's tensor"
            )


def verify(
    fn: Callable[..., Any],
    name: str,
    pool: GraphPool,
    entry: Entry,
    chain: Chain,
    memo: bcg.Memo | None,
    restore: Callable[[], None],
) -> None:
    """Raise unless one replay of ``chain`` equals an eager run of the same inputs bit for bit: its
    output, and what it leaves in the containers it was given.

    Breaks found automatically are only as safe as the function's purity, which nothing can
    prove from outside; this comparison is the evidence, for the warmed inputs.
    """
    sig = entry.signature
    args, kwargs = sig.rebuild(entry.static_inputs)
    with torch.inference_mode(False), torch.no_grad():
        with bcg.rerun(memo):
            expected = tree.clone((fn(*args, **kwargs), _containers(args, kwargs, sig.state)))
        restore()
        trial = GraphTree()
        trial.add(chain)
        args, kwargs = sig.rebuild(entry.static_inputs)
        got = (entry.replay(pool, trial, None, memo, call=(args, kwargs, None)), _containers(args, kwargs, sig.state))
        restore()
    (want, want_key), (have, have_key) = tree.flatten_key(expected), tree.flatten_key(got)
    same = want_key == have_key and all(_same_leaf(a, b) for a, b in zip(want, have))
    if not same:
        raise BreakError(f"{name}: the graph's output differs from an eager run of the same inputs")


def _containers(args: tuple[Any, ...], kwargs: dict[str, Any], state: frozenset[type]) -> list[Any]:
    """The containers a call was given, which it may have stored into."""
    return [c for _, c in containers.Given(args, kwargs, state).found]


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a is b or (type(a) is type(b) and isinstance(a, LITERALS) and a == b)
