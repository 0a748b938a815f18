"""A kernel's GPU time, not its host's: ``calls`` calls captured in one CUDA graph, replayed once
after a warm replay, timed by CUDA events. For the cuda tests that print a time beside another
(never asserted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["replayed_us"]


def replayed_us(fn: Callable[..., Any], *args: Any, calls: int = 50) -> float:
    """Microseconds per call of ``fn(*args)``, replayed from a CUDA graph."""
    for _ in range(3):  # compiled, autotuned and allocated before the capture
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000
