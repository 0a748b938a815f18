#!/usr/bin/env python
"""A bcg-serve --ray replica's cold start with an empty compile cache, then with the cache it wrote.

One Ray cluster on this machine; per run, one application of one replica, deleted after it (the
next run's replica is a fresh process: only the compile cache on disk carries over, as for a
replica that scales up on a node that ran one before). Writes ray_start.json and ray_start.md
after each run (scripts/benchkit/ray_start.py says what each column is).

    python scripts/bench_ray_start.py --out out/ray-start -- --model z-image --size full \\
        --resolutions 512x512 --batch-sizes 1 2 4 8 --compile
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

from benchkit.ray_start import parse_args, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    raise SystemExit(main())
