"""Where a profiled call's time goes, for scripts/bench_parallel.py: the kind of each kernel (or,
without CUDA, of each op) from its name, and the stretches the GPU ran no kernel at all."""

from __future__ import annotations

from typing import Any

# Kinds of kernel (or, without CUDA, of op) a profiled call's time is split into, first match wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d::", "all_to_all", "alltoall", "allgather", "all_gather", "allreduce")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_mha")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("copy", ("memcpy", "memset", "copy", "clone", "contiguous", "aten::cat")),
)
KIND_NAMES = (*(k for k, _ in KINDS), "other")


def kernel_kind(name: str) -> str:
    """The kind of a kernel or op, from its name."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def gpu_gaps(events: Any, top: int) -> tuple[float, list[tuple[tuple[str, str], tuple[float, int]]]]:
    """Milliseconds the GPU ran no kernel between the call's first and last kernel, and the
    ``top`` (kernel before, kernel after) pairs around the idle time, by total idle ms."""
    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name[:60]) for e in events if e.device_type == DeviceType.CUDA
    )
    idle = 0.0
    pairs: dict[tuple[str, str], tuple[float, int]] = {}
    end, last = None, ""
    for start, stop, name in kernels:
        if end is not None and start > end:
            gap = (start - end) / 1e3
            idle += gap
            t, n = pairs.get((last, name), (0.0, 0))
            pairs[(last, name)] = (t + gap, n + 1)
        if end is None or stop >= end:
            end, last = stop, name
    return idle, sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
