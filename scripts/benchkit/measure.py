"""Measuring: clocks (CUDA events on GPU, wall clock on CPU), GPU-busy fraction, device memory."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from accel import peak_memory, reset_peak_memory, tree

from .rows import err_text, rnd
from .settings import MiB


def max_abs_diff(a: Any, b: Any) -> float | None:
    """The largest difference between the tensors of two outputs (None where their shapes differ)."""
    ta, tb = tree.tensors(a), tree.tensors(b)
    if not ta or len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return None
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(ta, tb))


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_steps(self, fn: Callable[[], Any], repeats: int, warmup: int) -> tuple[float, float, float]:
        """(median step ms, median host ms, min step ms): each call timed alone, from idle."""
        for _ in range(warmup):
            fn()
        self.sync()
        steps, hosts = [], []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                t1 = time.perf_counter()
                end.synchronize()
                steps.append(start.elapsed_time(end))
                hosts.append((t1 - t0) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
                steps.append(ms)
                hosts.append(ms)
            self.sync()
        return statistics.median(steps), statistics.median(hosts), min(steps)

    def back_to_back(self, fn: Callable[[], Any], n: int, busy: bool) -> tuple[float, float | None, str | None]:
        """(wall ms per call over n back-to-back calls, GPU-busy fraction or None, why None)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        seq_ms = (time.perf_counter() - t0) / n * 1e3
        if not busy:
            return seq_ms, None, None
        if not self.cuda:
            return seq_ms, None, "no GPU"
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                self.sync()
                wall_ns = (time.perf_counter() - t0) * 1e9
            gpu_ns = _gpu_busy_ns(prof)
            if not gpu_ns:
                return seq_ms, None, "the profiler recorded no GPU activity"
            return seq_ms, min(1.0, gpu_ns / wall_ns), None
        except Exception as exc:  # the profiler is a nicety, never a failure of the variant
            return seq_ms, None, f"profiler failed: {err_text(exc)}"


def _gpu_busy_ns(prof: Any) -> int:
    """Union of the GPU intervals (kernels, copies, sets) the profiler saw, in ns."""
    intervals: list[tuple[int, int]] = []
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA and "sync" not in e.name().lower():
                intervals.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    except Exception:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                intervals.append((int(e.time_range.start * 1e3), int(e.time_range.end * 1e3)))
    intervals.sort()
    total, cur_s, cur_e = 0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class MemWatch:
    """Peak and growth of device memory over a block (reset at its start); no-op on CPU."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __enter__(self) -> MemWatch:
        if self.clock.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            reset_peak_memory(self.clock.device)  # the library's window: captures reset torch's counters
            self.base = torch.cuda.memory_allocated(self.clock.device)
            self.reserved0 = torch.cuda.memory_reserved(self.clock.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def numbers(self) -> dict[str, float | None]:
        """Read while the variant's objects (graphs, compiled code) are still alive."""
        if not self.clock.cuda:
            return {}
        dev = self.clock.device
        peak = peak_memory(dev)[0]
        return {
            "peak_mb": rnd(peak / MiB, 1),
            "peak_over_base_mb": rnd((peak - self.base) / MiB, 1),
            "reserved_growth_mb": rnd((torch.cuda.memory_reserved(dev) - self.reserved0) / MiB, 1),
        }


def drop_compiled(cuda: bool) -> None:
    """What a dropped pipeline still holds given back: its compiled code and its hooks' cycles hold
    its weights until dynamo lets go and the collector runs (a second full-size Qwen-Image would not
    fit beside them), then the allocator's cache."""
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def free_memory(clock: Clock) -> None:
    if clock.cuda:
        gc.collect()
        torch.cuda.synchronize(clock.device)
        torch.cuda.empty_cache()
