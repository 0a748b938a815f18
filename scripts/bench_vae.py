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

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchkit.vae_decode import parse_args, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(main())
