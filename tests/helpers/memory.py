"""Where a GPU suite's memory went: one line per stage in a file, when one test alone never shows it."""

from __future__ import annotations

import os

import torch

# A file to append each test's memory to, before and after it (allocated, reserved, and what each
# graph pool reserves): where a suite's memory went, when one test alone never shows it.
MEMORY_LOG = os.environ.get("BCG_TEST_MEMORY_LOG")


def log_memory(when: str, name: str) -> None:
    """Append the device's memory now to ``BCG_TEST_MEMORY_LOG`` (nothing if unset); tests call it between their stages too."""
    if not MEMORY_LOG or not torch.cuda.is_available():
        return
    pools: dict[tuple, int] = {}
    pinned = 0  # free bytes in segments that a live block keeps from being given back
    for s in torch.cuda.memory._snapshot()["segments"]:  # type: ignore[attr-defined]
        key = tuple(s.get("segment_pool_id", (0, 0)))
        pools[key] = pools.get(key, 0) + s["total_size"]
        if s["allocated_size"]:
            pinned += s["total_size"] - s["allocated_size"]
    free, _ = torch.cuda.mem_get_info()
    gib = 2**30
    with open(MEMORY_LOG, "a") as f:
        f.write(
            f"{when} {name}: allocated {torch.cuda.memory_allocated() / gib:.1f} reserved "
            f"{torch.cuda.memory_reserved() / gib:.1f} (pinned free {pinned / gib:.1f}) free {free / gib:.1f} GiB; pools "
            + ", ".join(f"{k}: {v / gib:.2f}" for k, v in sorted(pools.items()))
            + "\n"
        )
