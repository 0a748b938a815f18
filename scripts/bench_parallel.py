#!/usr/bin/env python
"""One image on several GPUs: pipeline latency on N GPUs against one GPU, eager and graphs, one launch.

    torchrun --nproc_per_node 2 scripts/bench_parallel.py --out out/parallel
    torchrun --nproc_per_node 2 scripts/bench_parallel.py --models qwen-image --resolutions 1024 --out out/p
    torchrun --nproc_per_node 2 scripts/bench_parallel.py --size tiny --out /tmp/p   # CPU smoke (gloo)

Every process builds each model once (full size, random weights, bf16, on ``cuda:LOCAL_RANK``)
and runs, per resolution, the same pipeline call (same prompt, seed and steps) in these variants:

* ``1 GPU eager`` / ``1 GPU graphs``: rank 0 alone (the others wait at a barrier): the stock
  pipeline, then ``accelerate_pipeline(pipe)`` with a warm-up.
* ``cfg eager`` / ``cfg graphs`` (``parallel="cfg"``, 2 ranks): Qwen-Image's two guidance
  branches on two GPUs. Z-Image batches its branches into one call (and runs without guidance
  as Turbo), so it has none.
* ``ulysses eager`` / ``ulysses graphs`` (``parallel="ulysses"``): diffusers' Ulysses context
  parallelism over all ranks.
* ``cfg+ulysses eager`` / ``graphs`` on 4 or more ranks.
* with ``--branches-apart``, Qwen-Image's ``ulysses graphs`` again with ``cfg_batch=False``
  (``ulysses graphs, branches apart``): its two guidance calls one after the other rather than
  joined into one batch-2 call (see ``accel.hooks.cfg_batch``).

Latency: the wall time of the whole pipeline call on rank 0 (``output_type="latent"`` by default:
text encoding and denoising, no VAE decode, which every rank repeats alike), from a barrier and
an idle GPU to the last kernel, median of ``--runs`` after one warm-up call. Graph variants report
their warm-up (capture) seconds. ``diff`` is the largest difference of the final latents (of the
decoded pixels with ``--output-type pil``) from the one-GPU run of the same kind (eager against
eager, graphs against graphs), relative to the largest value: 0 means bit-identical. Models run
with their usual settings: Qwen-Image true CFG (scale 4, a negative prompt), Z-Image 9 steps
without guidance; ``--steps`` overrides both.

``--profile`` runs one more call of every variant under ``torch.profiler`` and adds a second
table: rank 0's kernel time in that call by kind (communication, attention, GEMM, copies, the
rest; CPU op time on a machine without CUDA) and the time its GPU ran no kernel at all, which
says where a parallel layout's time goes; results.json adds the largest kernels and the kernel
pairs around the longest idle stretches.
``--skip-parallel-eager`` leaves out the eager parallel variants (slow, and only a reference).

Outputs under ``--out``: ``results.json`` and ``results.md`` (device, versions, the tables); rank 0
prints them. About 5 minutes on 2 H200s with the defaults (both models, 512 and 1024).
"""

from __future__ import annotations

import sys

from benchkit.parallel_run import build_parser, run


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(__doc__.split("\n\n")[0]).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
