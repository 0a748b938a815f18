#!/usr/bin/env python
"""Breadth table: the zoo's diffusers pipelines at their released denoiser configs, eager vs graphs
vs compiled graphs, each in its own process.

    python scripts/bench_breadth.py --out out/breadth                          # GPU: eager and graphs
    python scripts/bench_breadth.py --only flux,sdxl --variants eager,graphs,compiled --out out/bc
    python scripts/bench_breadth.py --size tiny --only flux,wan --out /tmp/breadth  # CPU, seconds

Every family of :mod:`pipelines.zoo` (``--only`` picks some) is built with random weights and no
text encoders (random prompt embeddings of the shapes its encoders produce, seeded), at
``--size full`` (the released denoiser and VAE, bf16; the default on CUDA) or ``tiny`` (the CPU
default), and run at its usual geometry with ``output_type="latent"``. Each family runs in a
child process with ``--timeout`` seconds, so a failure, a hang or an out-of-memory ends only that
family; results are written after every family (and by the child after every variant, so a
timeout keeps the variants finished before it). In one process, side by side:

* ``eager``: the stock pipeline, one untimed call, then timed calls at each of ``--steps``
  (default 2 and 4). Per step is the slope of time over steps, the fixed cost its intercept (text
  handling, latents, scheduler set-up); end to end at the family's usual step count is derived
  from them: fixed + usual x per step (no call at the usual count is made).
* ``graphs``: ``accelerate_pipeline(pipe)`` with default options, ``pipe.accel.warmup`` at the
  geometry (its guidance branches, frames and the call's own embeddings; on a CPU no warm-up:
  graphs never capture there), one untimed call, the same timed calls. The latents are compared
  with eager's bit for bit (``torch.equal``) at every step count; the denoisers' counters
  (``pipe.accel.stats()``), the breaks found and, where no graph was kept, the report's reason are
  recorded, and whether the warm-up covered the calls (no miss, no eager call after it).
* ``compiled`` (CUDA only): ``accelerate_pipeline(pipe, compile=True)`` and a warm-up, the same
  timed calls; the graphs are compared bit for bit with the same compiled model with its runners
  off (a reference call), and the distance of compiled to stock eager is recorded. Skipped where
  the denoiser declares no ``_repeated_blocks``.

Times are host wall clock around a synchronised call. Outputs under ``--out``: ``breadth.json``
(device and versions, every number, the reports) and ``breadth.md`` (the table), plus
``logs/FAMILY.log`` (each child's log) and ``parts/FAMILY.json`` (each child's result).

All 16 families, eager and graphs, full size on one H200: about 6 minutes (an estimate from
earlier per-family timings; the video models take 40 to 70 s each). The compiled variant adds
each model's inductor compile (40 s to over 2 minutes): run it for a few families with a longer
``--timeout``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from benchkit import settings
from benchkit.breadth_cli import build_parser
from benchkit.breadth_family import run_family
from benchkit.breadth_parent import run_families

# The parent's clock start, handed to its children so their progress lines share its time axis
# (perf_counter is one monotonic clock for every process of the machine).
CLOCK_ENV = "BCG_BREADTH_T_START"


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.worker:
        with contextlib.suppress(KeyError, ValueError):
            settings.T_START = float(os.environ[CLOCK_ENV])
        return run_family(args.worker, args, Path(args.result))
    os.environ[CLOCK_ENV] = repr(settings.T_START)
    return run_families(args, argv)


if __name__ == "__main__":
    sys.exit(main())
