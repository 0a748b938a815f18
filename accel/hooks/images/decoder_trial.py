"""The VAE decoder's graphs kept only where they pay: each size timed against eager at warm-up.

A decoder's graphs save launches, but a decode at a large size is compute-bound, and there its
graph only costs: its activations stay resident (the largest a pipeline has), and a decoder that
fills the feature cache it is given (Qwen-Image's causal decoder) has every replay copy out what
it stored (2.3 GiB at 1024x1024), which made its replay slower than eager (84.1 against 77.7 ms
on an H100). So the warm-up decides per size, by measurement, never by guess:

1. the component call of a size captures the decoder into a pool of its own, not the pipeline's;
2. its replay is timed (the best of :data:`TIMED_RUNS` after one untimed run, CUDA events on the
   current stream), the trial graph is let go with its pool, and the same call is timed eagerly
   (the same way), so no eager decode ever runs beside a trial graph's memory;
3. sizes whose replay was at least as fast as eager are captured again at the end, into the
   pipeline's shared pool, where the decoder and the denoiser reuse each other's blocks (only one
   runs at a time); the others are decoded eagerly: their signatures are refused with
   :data:`SLOWER` and the times, which ``report()`` and the warm-up table show.

A failed capture stays failed. A later warm-up decides again for sizes it has no verdict for.
Only timed where the graphs run on CUDA (:func:`timed_on`): emulated graphs on a CPU keep the
decoder's graphs untimed, as their times would say nothing of a GPU's.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ...graphs.runner import GraphRunner

__all__ = ["SLOWER", "TIMED_RUNS", "DecoderTrial", "Timing", "best_ms", "timed_on"]

logger = logging.getLogger(__name__)

# The start of the reason a size decoded eagerly is refused with (report() says it apart from failures).
SLOWER = "graphs not kept: the replay was slower than the eager decode"
TIMED_RUNS = 2

Size = tuple[int, int, int | None]


def timed_on(device: torch.device) -> bool:
    """Whether the decoder's graphs are timed against eager on ``device`` (CUDA only)."""
    return device.type == "cuda"


def best_ms(fn: Callable[[], Any], device: torch.device, runs: int = TIMED_RUNS) -> float:
    """The fastest of ``runs`` timed calls of ``fn`` after one untimed call, in milliseconds:
    CUDA events on the current stream on a GPU (launch gaps included), the host clock elsewhere."""
    fn()
    times = []
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
    return min(times)


@dataclasses.dataclass
class Timing:
    """One decoder call signature at one warm-up size: its replay and eager times, and the verdict."""

    size: Size
    key: Hashable
    graph_ms: float
    eager_ms: float

    @property
    def kept(self) -> bool:
        return self.graph_ms <= self.eager_ms

    @property
    def label(self) -> str:
        w, h, frames = self.size
        return f"{w}x{h}" + (f", {frames} frames" if frames is not None else "")

    def reason(self) -> str:
        return f"{SLOWER} at {self.label} ({self.graph_ms:.1f} ms against {self.eager_ms:.1f} ms eager)"


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
    """

    def __init__(self, runner: GraphRunner, name: str) -> None:
        self.runner = runner
        self.name = name
        self.shared = runner.pool
        self.timings: list[Timing] = []
        self._kept: list[_Trial] = []
        self._had: set[Hashable] = set()

    def before_call(self) -> None:
        """The next component call captures the decoder into a pool of its own (graphs it has
        already replay as they are)."""
        shared = self.shared
        assert shared is not None
        trial = type(shared)(shared.device)
        trial.give_back_before_capture = shared.give_back_before_capture
        self._had = set(self.runner.store.entries)
        self.runner.pool = trial

    def after_call(self, size: Size) -> list[Timing]:
        """Time what the call captured, let the trial graphs and their pool go, time the same
        calls eagerly, refuse the signatures whose graphs were slower; the timings."""
        runner, shared = self.runner, self.shared
        assert shared is not None
        device = shared.device
        new = [k for k in runner.store.entries if k not in self._had]
        trials = self._time_replays(new, size, device)
        runner.block(new, "on trial")  # drops the trial graphs
        runner.pool = shared
        gc.collect()  # the trial graphs (cycles; the warm-up keeps the collector off), then their pool
        shared.release_cached()
        with torch.no_grad():
            for t in trials:
                t.timing.eager_ms = best_ms(functools.partial(_invoke, runner.fn, t.signature, t.static_inputs), device)
        shared.release_cached()  # the eager decodes' transient
        for t in trials:
            self.timings.append(t.timing)
            if t.timing.kept:
                runner.store.blocked.pop(t.timing.key, None)
                self._kept.append(t)
            else:
                runner.block([t.timing.key], t.timing.reason())
                logger.info("%s: %s", self.name, t.timing.reason())
        return [t.timing for t in trials]

    def _time_replays(self, keys: list[Hashable], size: Size, device: torch.device) -> list[_Trial]:
        runner = self.runner
        trials = []
        with torch.no_grad():
            for key in keys:
                entry = runner.store.entries[key]
                statics = list(entry.static_inputs)
                call = functools.partial(_invoke, runner, entry.signature, statics)
                trials.append(_Trial(Timing(size, key, best_ms(call, device), 0.0), entry.signature, statics))
        return trials

    def finish(self, added: Callable[[Size, int, int, float], None]) -> None:
        """Capture the kept sizes again, into the shared pool (largest first, as timed);
        ``added(size, graphs, bytes, seconds)`` is told what each added (the pool's growth, static
        inputs, boundary buffers)."""
        runner, pool = self.runner, self.shared
        assert pool is not None
        runner.pool = pool
        for t in self._kept:
            before = pool.resident_bytes() + _held(runner)
            t0 = time.perf_counter()
            with torch.no_grad():
                ok = _invoke(runner.capture, t.signature, t.static_inputs)
            added(t.timing.size, int(ok), pool.resident_bytes() + _held(runner) - before, time.perf_counter() - t0)
            logger.info(
                "%s: graphs kept at %s (%.1f ms against %.1f ms eager)",
                self.name,
                t.timing.label,
                t.timing.graph_ms,
                t.timing.eager_ms,
            )
        self._kept.clear()


def _held(runner: GraphRunner) -> int:
    s = runner.stats(memory=True, pool=False)
    return s.static_bytes + s.boundary_bytes


def _invoke(fn: Callable[..., Any], signature: Any, statics: list[torch.Tensor]) -> Any:
    """``fn`` called as the signature was, its tensors ``statics``, its containers fresh."""
    args, kwargs = signature.rebuild(statics)
    return fn(*args, **kwargs)
