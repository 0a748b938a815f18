#!/usr/bin/env python
"""Peak memory of graphs against eager's, per model, in one process: what the graphs cost beyond eager's own peak.

    python scripts/bench_memory.py --out out/memory                   # both models, full size, bf16
    python scripts/bench_memory.py --only z-image --out out/memory-z
    python scripts/bench_memory.py --variants graphs --out out/m       # eager always runs first
    python scripts/bench_memory.py --size tiny --out /tmp/m            # CPU smoke (no memory numbers)

Per model (Qwen-Image at 1328x1328, 1024x1024 and 512x512 with true CFG; Z-Image at 1536x864,
1024x1024 and 512x512 without guidance; full size, random weights, bf16 on CUDA; ``--steps`` steps,
2 by default: memory does not depend on it), the pipeline built once, in this order:

* ``eager``: the stock pipeline, one decoded call per size, largest first, from an emptied cache:
  the peak reserved memory (the bar) and allocated memory, and the weights.
* ``graphs``: ``accelerate_pipeline(pipe)`` and ``warmup(sizes)`` (the calls' prompt; Qwen-Image's
  negative prompt), then the same calls, from what the warm-up left (its pool, its cache given
  back): their peak reserved memory against eager's (``x eager``, the bar: at most 1.05), and the
  warm-up's own peak beside it. The warm-up table (graph MiB added and the eager peak it replaces
  per size; the VAE decoder's replay and eager times and whether its graphs were kept) and
  ``report()`` are kept in results.json, and results.md has the peak after each call beside the
  decoder's trial at that size (its verdict, its graphs' pool, a replay's copies out, the eager
  decode's transient): a peak that rises at a size whose decode ran eagerly beside kept graphs
  shows there.
* ``graphs-compiled``: the same with ``compile=True``, inductor's cache in a fresh folder (cold)
  unless ``--compile-cache`` names one.

Peaks are torch's counters (``accel.graphs.pool.peak_memory``: across the resets a warm-up makes to
measure its eager runs). Writes results.json and results.md to ``--out`` after every row.
"""

from __future__ import annotations

from benchkit.memory_run import parse_args, run


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    main()
