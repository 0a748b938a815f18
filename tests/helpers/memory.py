"""Where a GPU suite's memory went: one line per stage in a file, when one test alone never shows it."""

from __future__ import annotations

import gc
import os
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor

# A file to append each test's memory to, before and after it (allocated, reserved, and what each
# graph pool reserves): where a suite's memory went, when one test alone never shows it.
MEMORY_LOG = os.environ.get("BCG_TEST_MEMORY_LOG")
# Pinned free memory above which the segments that pin it, and the tensors still alive, are listed.
DETAIL_ABOVE = 4 << 30
GIB = 2**30


def log_memory(when: str, name: str) -> None:
    """Append the device's memory now to ``BCG_TEST_MEMORY_LOG`` (nothing if unset); tests call it between their stages too."""
    if not MEMORY_LOG or not torch.cuda.is_available():
        return
    segments = torch.cuda.memory._snapshot()["segments"]  # type: ignore[attr-defined]
    pools: dict[tuple, int] = {}
    pinned = 0  # free bytes in segments that a live block keeps from being given back
    for s in segments:
        key = tuple(s.get("segment_pool_id", (0, 0)))
        pools[key] = pools.get(key, 0) + s["total_size"]
        if s["allocated_size"]:
            pinned += s["total_size"] - s["allocated_size"]
    free, _ = torch.cuda.mem_get_info()
    lines = [
        f"{when} {name}: allocated {torch.cuda.memory_allocated() / GIB:.1f} reserved "
        f"{torch.cuda.memory_reserved() / GIB:.1f} (pinned free {pinned / GIB:.1f}) free {free / GIB:.1f} GiB; pools "
        + ", ".join(f"{k}: {v / GIB:.2f}" for k, v in sorted(pools.items()))
    ]
    if pinned > DETAIL_ABOVE:
        lines += _pinning_segments(segments) + _live_cuda_tensors()
    with open(MEMORY_LOG, "a") as f:
        f.write("\n".join(lines) + "\n")


def _pinning_segments(segments: list[dict], top: int = 8) -> list[str]:
    """The segments that hold the most free memory behind a live block, with their live blocks' sizes."""
    held = sorted(
        (s for s in segments if s["allocated_size"]), key=lambda s: s["total_size"] - s["allocated_size"], reverse=True
    )
    out = [f"  {len(held)} of {len(segments)} segments hold live blocks; the most free behind them:"]
    for s in held[:top]:
        live = [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"]
        out.append(
            f"    pool {tuple(s.get('segment_pool_id', (0, 0)))} stream {s.get('stream')} segment {s['total_size'] / 2**20:.0f} MiB, "
            f"{len(live)} live blocks of {s['allocated_size'] / 2**20:.1f} MiB: "
            + ", ".join(f"{n / 2**20:.2f}" for n in live[:8])
        )
    return out


def _live_cuda_tensors(top: int = 8) -> list[str]:
    """The CUDA tensors the collector can see, largest first (a slow walk: only when much is pinned)."""
    seen: dict[int, tuple[int, str]] = {}
    # Asking every object whether it is a tensor wakes deprecation warnings (torch.distributed's
    # reduce_op); dynamo's fake tensors own no memory.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.is_cuda:
                    storage = o.untyped_storage()
                    seen[storage.data_ptr()] = (storage.nbytes(), f"{type(o).__name__}{tuple(o.shape)} {o.dtype}")
            except Exception:  # a tensor subclass or a freed storage
                continue
    total = sum(n for n, _ in seen.values())
    big = sorted(seen.values(), reverse=True)[:top]
    return [
        f"  {len(seen)} CUDA storages the collector sees, {total / GIB:.1f} GiB; largest: "
        + ", ".join(f"{d} {n / 2**20:.0f} MiB" for n, d in big)
    ]
