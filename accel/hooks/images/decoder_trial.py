"""The VAE decoder's graphs kept only where they pay: each size measured against eager at warm-up.

A decoder's graphs save launches, but a decode at a large size is compute-bound, and there its
graph may only cost: its activations stay resident (the largest a pipeline has), and a decoder that
fills the feature cache it is given (Qwen-Image's causal decoder) has every replay copy out what
it stored (gigabytes at 1024x1024), which made its replay slower than eager (docs/benchmarks.md).
So the warm-up decides by measurement, never by guess:

1. the component call of a size captures the decoder into a pool of its own, not the pipeline's;
2. its replay is measured (:func:`measure`: the best of :data:`TIMED_RUNS` after one untimed run,
   CUDA events on the current stream, the spread of the runs, and what the runs allocate beside
   the pool), with the graph memory its pool holds; then the trial graph is let go with its pool
   and the same call is measured eagerly, so no eager decode ever runs beside a trial graph's
   memory;
3. at the end of the warm-up :func:`~accel.hooks.images.decoder_verdict.choose` decides which
   sizes keep graphs, by time and by the peak memory they leave the process at
   (:mod:`accel.hooks.images.decoder_verdict` has the rule); those are captured again, into the
   pipeline's shared pool, where the decoder and the denoiser reuse each other's blocks (only one
   runs at a time); the others are decoded eagerly: their signatures are refused with
   :data:`~accel.hooks.images.decoder_verdict.NOT_KEPT` and why, which ``report()`` and the
   warm-up table show.

A failed capture stays failed. A later warm-up decides for the sizes it has no verdict for, the
earlier verdicts as they are. Only measured where the graphs run on CUDA (:func:`timed_on`):
emulated graphs on a CPU keep the decoder's graphs unmeasured, as their times would say nothing
of a GPU's.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ...graphs.runner import GraphRunner
from .decoder_verdict import NOT_KEPT, Timing, choose

__all__ = ["NOT_KEPT", "TIMED_RUNS", "DecoderTrial", "Measured", "Timing", "measure", "timed_on"]

logger = logging.getLogger(__name__)

TIMED_RUNS = 3

Size = tuple[int, int, int | None]


def timed_on(device: torch.device) -> bool:
    """Whether the decoder's graphs are measured against eager on ``device`` (CUDA only)."""
    return device.type == "cuda"


@dataclasses.dataclass
class Measured:
    """Timed calls of one function: the fastest (ms), the spread of the timed runs (ms), and the
    most they allocated on the device above what was allocated before them (bytes; 0 off CUDA)."""

    best_ms: float
    spread_ms: float
    peak_bytes: int


def measure(fn: Callable[[], Any], device: torch.device, pool: Any, runs: int = TIMED_RUNS) -> Measured:
    """``fn`` run once untimed, then ``runs`` times timed: CUDA events on the current stream on a
    GPU (launch gaps included), the host clock elsewhere; what the calls allocate beside the graph
    pools measured through ``pool``'s counters
    (:meth:`~accel.graphs.pool.GraphPool.measure_eager`), whose own
    account of eager peaks (the warm-up's) is left as it was."""
    times = []
    kept = pool.take_eager_peak()
    try:
        with pool.measure_eager():
            fn()
            for _ in range(runs):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
        peak = pool.take_eager_peak()
    finally:
        pool.eager_peak = kept
    return Measured(min(times), max(times) - min(times), peak)


def graph_bytes(runner: GraphRunner, keys: Sequence[Hashable]) -> int:
    """What ``runner``'s trial graphs (the signatures ``keys``, alone in their pool) hold in it."""
    pool = runner.pool
    return pool.resident_bytes() if pool is not None else 0


@dataclasses.dataclass
class _Trial:
    timing: Timing
    signature: Any
    static_inputs: list[torch.Tensor]


class DecoderTrial:
    """Decides which of ``runner``'s signatures (a VAE decoder's) keep graphs; used by the warm-up
    around its component calls (see the module docstring).

    Args:
        runner: the decoder's runner; its pool is the pipeline's shared pool.
        name: for messages.
        earlier: the timings of sizes earlier warm-ups decided (kept as they are, and weighed in).
    """

    def __init__(self, runner: GraphRunner, name: str, earlier: Sequence[Timing] = ()) -> None:
        self.runner = runner
        self.name = name
        self.shared = runner.pool
        self.earlier = [t for t in earlier if t.kept is not None]
        self.timings: list[Timing] = []
        self._trials: list[_Trial] = []
        self._had: set[Hashable] = set()
        self._held = 0

    def before_call(self) -> None:
        """The next component call captures the decoder into a pool of its own (graphs it has
        already replay as they are)."""
        shared = self.shared
        assert shared is not None
        trial = type(shared)(shared.device)
        trial.give_back_before_capture = shared.give_back_before_capture
        self._had = set(self.runner.store.entries)
        self._held = _held(self.runner)
        self.runner.pool = trial

    def after_call(self, size: Size) -> list[Timing]:
        """Measure what the call captured, let the trial graphs and their pool go, measure the same
        calls eagerly; the timings (decided at :meth:`finish`)."""
        runner, shared = self.runner, self.shared
        assert shared is not None
        device = shared.device
        new = [k for k in runner.store.entries if k not in self._had]
        trials = self._measure_replays(new, size, device)
        runner.block(new, "on trial")  # drops the trial graphs
        runner.pool = shared
        gc.collect()  # the trial graphs (cycles; the warm-up keeps the collector off), then their pool
        shared.release_cached()
        with torch.no_grad():
            for t in trials:
                eager = measure(functools.partial(_invoke, runner.fn, t.signature, t.static_inputs), device, shared)
                t.timing.eager_ms, t.timing.eager_bytes = eager.best_ms, eager.peak_bytes
                t.timing.noise_ms = max(t.timing.noise_ms, eager.spread_ms)
        shared.release_cached()  # the eager decodes' transient
        self._trials += trials
        self.timings += [t.timing for t in trials]
        return [t.timing for t in trials]

    def _measure_replays(self, keys: list[Hashable], size: Size, device: torch.device) -> list[_Trial]:
        runner = self.runner
        trials: list[_Trial] = []
        if not keys:
            return trials
        with torch.no_grad():
            for key in keys:
                entry = runner.store.entries[key]
                statics = list(entry.static_inputs)
                call = functools.partial(_invoke, runner, entry.signature, statics)
                replay = measure(call, device, self.shared)
                timing = Timing(
                    size, key, replay.best_ms, 0.0, noise_ms=replay.spread_ms, replay_bytes=replay.peak_bytes
                )
                trials.append(_Trial(timing, entry.signature, statics))
        # One decoder signature per size: each holds what the call's graphs hold.
        held, pooled = max(0, _held(runner) - self._held), graph_bytes(runner, keys)
        for t in trials:
            t.timing.graph_bytes, t.timing.held_bytes = pooled, held
        return trials

    def finish(self, added: Callable[[Size, int, int, float], None]) -> None:
        """Decide (:func:`~accel.hooks.images.decoder_verdict.choose`), capture the kept sizes
        again, into the shared pool (largest first, as measured), and refuse the others;
        ``added(size, graphs, bytes, seconds)`` is told what each capture added (the pool's growth,
        static inputs, boundary buffers)."""
        runner, pool = self.runner, self.shared
        assert pool is not None
        runner.pool = pool
        trials, self._trials = self._trials, []
        if not trials:
            return
        again = {t.timing.key for t in trials}  # sizes measured again (their graphs were released)
        choose([t.timing for t in trials], [t for t in self.earlier if t.key not in again], pool.resident_bytes())
        for t in trials:
            timing = t.timing
            if not timing.kept:
                runner.block([timing.key], timing.reason())
                logger.info("%s: %s", self.name, timing.reason())
                continue
            runner.store.blocked.pop(timing.key, None)
            before = pool.resident_bytes() + _held(runner)
            t0 = time.perf_counter()
            with torch.no_grad():
                ok = _invoke(runner.capture, t.signature, t.static_inputs)
            added(timing.size, int(ok), pool.resident_bytes() + _held(runner) - before, time.perf_counter() - t0)
            logger.info("%s: graphs kept at %s (%s; %s)", self.name, timing.label, timing.times(), timing.memory())


def _held(runner: GraphRunner) -> int:
    s = runner.stats(memory=True, pool=False)
    return s.static_bytes + s.boundary_bytes


def _invoke(fn: Callable[..., Any], signature: Any, statics: list[torch.Tensor]) -> Any:
    """``fn`` called as the signature was, its tensors ``statics``, its containers fresh."""
    args, kwargs = signature.rebuild(statics)
    return fn(*args, **kwargs)
