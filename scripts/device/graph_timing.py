"""Kernel times without launch overhead, for the probes of scripts/device/: a callable captured
``reps`` times back to back in one CUDA graph, replayed, timed with CUDA events."""

from __future__ import annotations

import statistics
from collections.abc import Callable

__all__ = ["graph_ms"]


def graph_ms(fn: Callable[[], object], reps: int = 20, rounds: int = 15) -> float:
    """Milliseconds of one ``fn()`` call: the median over ``rounds`` replays of a graph holding
    ``reps`` calls (three warm-up calls first, outside the capture)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)
