"""One process of scripts/bench_restart.py: build a pipeline, accelerate it with ``compile=True`` and
the given compile cache folder, warm up every resolution, and say what that cost.

The parent starts this process with the cache folder in the environment (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``, ``BCG_COMPILE_CACHE``) and passes it to ``accelerate_pipeline`` as
``compile_cache_dir`` too, so every persistent cache torch keeps (inductor's FX graph cache,
AOTAutograd's cache, Triton's kernels) lives in it and nothing of an earlier process outside it
is found. The result (one JSON file) holds the times of the process's parts, the warm-up's split
into compile and capture seconds per resolution, and the compile caches' hit and miss counters,
which tell a warm start from a cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()

import torch  # noqa: E402

from .settings import SEED, res_name, uses_cfg  # noqa: E402

__all__ = ["CACHE_ENV", "cache_counters", "folder_size", "run"]

# What the child's environment points at the cache folder (the library's own variable too).
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "BCG_COMPILE_CACHE")
# torch's counters of its persistent caches: (group, name).
_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("stats", "unique_graphs"),
)


def cache_counters() -> dict[str, int]:
    """Dynamo's and inductor's counters of compiled graphs and persistent-cache hits, this process."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][name]) for group, name in _COUNTERS}


def folder_size(folder: Path) -> dict[str, int]:
    """Files and bytes under ``folder``."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, accelerate, warm up; the process's result (see the module docstring)."""
    from accel import accelerate_pipeline
    from pipelines.builders import build_pipeline

    from .calls import register_recipes, warm_up

    imported_s = time.perf_counter() - T0
    register_recipes()
    device = torch.device(args.device)
    folder = Path(args.cache)
    env = {k: os.environ.get(k) for k in CACHE_ENV}
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = build_pipeline(args.model, size=args.size, device=device, dtype=dtype, seed=SEED)
    pipe.set_progress_bar_config(disable=True)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    accelerate_pipeline(pipe, compile=True, compile_cache_dir=folder)
    cfg = uses_cfg(args.model)
    with torch.no_grad():
        report = warm_up(pipe, args.resolutions, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    compiled = [r for r in pipe.accel.report().splitlines() if "compil" in r.lower()]
    return {
        "model": args.model,
        "size": args.size,
        "device": str(device),
        "resolutions": [res_name(wh) for wh in args.resolutions],
        "cache_env": env,
        "imported_s": round(imported_s, 2),
        "build_s": round(build_s, 2),
        "warmup_s": round(warmup_s, 2),
        "compile_s": round(report.total_compile_seconds, 2),
        "capture_s": round(report.total_seconds, 2),
        "compiled_graphs": report.compiled_graphs,
        "capture_passes": report.capture_passes,
        "captures": report.total_captures,
        "skipped": report.skipped,
        "rows": [
            {"resolution": r.size, "capture_s": round(r.seconds, 2), "compile_s": round(r.compile_seconds, 2)}
            for r in report.rows
        ],
        "counters": cache_counters(),
        "cache_after": folder_size(folder),
        "report_lines": compiled[:8],
    }


def main(args: argparse.Namespace) -> int:
    """The child's entry: run, write the result to ``args.result``."""
    result = run(args)
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))
    return 0
