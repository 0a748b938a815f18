#!/usr/bin/env python
"""The VAE decode of one image, side by side in one process: eager, under the library's graph,
and in channels-last memory format (eager and graphed).

Builds an embedded pipeline (full size on CUDA), accelerates it, warms up one resolution (which
captures the VAE decoder's graph in the denoiser's pool), then times ``pipe.vae.decode`` on the
latents of that resolution: median of ``--repeats`` CUDA-event timings after warm-up calls, the
decoder's runner enabled (graph replay) and disabled (the stock decoder, eagerly), and the same
after ``pipe.vae.to(memory_format=torch.channels_last)`` (the graph captured again). Each output
is compared with the first eager one. ``--top N`` adds the N costliest GPU kernels of one decode
of each variant (torch.profiler).

    python scripts/bench_vae.py --model z-image --resolution 1024 --out out/vae
"""

from __future__ import annotations

import sys

from benchkit.vae_decode import parse_args, run


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(main())
