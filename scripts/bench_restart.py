#!/usr/bin/env python
"""Warm-up after a restart: ``compile=True`` warm-up of a model at several resolutions in a first
process with an empty compile cache folder, then in a second process with the same folder.

Each process (:mod:`benchkit.restart_child`) builds the pipeline, calls
``accelerate_pipeline(pipe, compile=True, compile_cache_dir=FOLDER)`` and
``pipe.accel.warmup(resolutions, ...)`` (Qwen-Image with true CFG and a negative prompt), and times
the warm-up: compile seconds (the uncaptured calls that compile) and capture seconds, per
resolution, with torch's persistent-cache counters (FX graph cache and AOTAutograd cache hits and
misses, graphs dynamo compiled). The folder is also each child's ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR`` (its ``triton`` subfolder) and ``BCG_COMPILE_CACHE``, so the first process
starts cold whatever the machine's default folders hold, and the second finds only what the first
wrote. The ratio is the second warm-up over the first; the bar is at most 0.5.

Outputs under ``--out``: restart.json (both processes' results, the ratio) and restart.md; the
cache folder is ``--out``/compile-cache unless ``--cache`` names another, which must not exist or
be empty, and is kept (``--drop-cache`` deletes it at the end).

    python scripts/bench_restart.py --model z-image --out out/restart/z-image        # GPU, five resolutions
    python scripts/bench_restart.py --model z-image --size tiny --out /tmp/restart   # CPU: nothing compiles

On a CPU nothing compiles (``compile=True`` needs CUDA) and no graph is captured: the two
processes only show that the measurement runs; the numbers need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchkit.settings import parse_resolution, res_name, say

MODELS = ("z-image", "qwen-image", "flux")
RESOLUTIONS = {
    "full": [(256, 256), (512, 512), (768, 768), (1024, 1024), (768, 512)],  # scripts/bench.py's five
    "tiny": [(64, 64), (96, 64)],
}
BAR = 0.5  # warm at most half of cold (issue #49)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Warm-up with compile=True in a cold process, then in a second one with its compile cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--resolutions", type=parse_resolution, nargs="+", default=None, help="WxH; default: five")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--cache", default=None, help="the compile cache folder (default: OUT/compile-cache)")
    p.add_argument("--drop-cache", action="store_true", help="delete the cache folder at the end")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each process may take (default 900)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.device == "cuda" and not cuda:
        p.error("--device cuda: CUDA is not available here")
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    if args.size == "full" and args.device != "cuda":
        p.error("--size full needs a CUDA device (use --size tiny on a CPU)")
    args.resolutions = list(dict.fromkeys(args.resolutions or RESOLUTIONS[args.size]))
    args.cache = str(Path(args.cache or Path(args.out) / "compile-cache").resolve())
    if not args.child and Path(args.cache).exists() and any(Path(args.cache).iterdir()):
        p.error(f"--cache {args.cache} is not empty: the first process must start cold")
    return args


def child_env(folder: Path) -> dict[str, str]:
    """The environment of a measured process: every persistent compile cache in ``folder``."""
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(folder), TRITON_CACHE_DIR=str(folder / "triton"))
    env["BCG_COMPILE_CACHE"] = str(folder)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    return env


def one_process(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """Run the measured warm-up in a fresh process; its result, with its wall time."""
    result = Path(args.out) / f"{which}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--result", str(result)]
    argv += ["--model", args.model, "--size", args.size, "--device", args.device, "--out", args.out]
    argv += ["--cache", args.cache, "--resolutions", *(res_name(wh) for wh in args.resolutions)]
    say(f"{which} process: warm-up of {len(args.resolutions)} resolution(s), cache {args.cache}")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=child_env(Path(args.cache)), capture_output=True, text=True, timeout=args.timeout)
    wall_s = time.perf_counter() - t0
    (Path(args.out) / f"{which}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the {which} process failed ({proc.returncode}); see {Path(args.out) / f'{which}.log'}")
    data = json.loads(result.read_text())
    data["process_s"] = round(wall_s, 2)
    say(f"{which}: warm-up {data['warmup_s']} s (compile {data['compile_s']} s, capture {data['capture_s']} s)")
    return data


def summary(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        return round(warm[key] / cold[key], 3) if cold[key] else None

    notes = []
    if not cold["compiled_graphs"]:
        notes.append(f"nothing was compiled ({cold['skipped'] or 'compile=True needs CUDA'}): no cache to reuse")
    elif warm["counters"]["fxgraph_cache_miss"]:
        notes.append(f"the second process missed the FX graph cache {warm['counters']['fxgraph_cache_miss']} time(s)")
    r = ratio("warmup_s")
    return {
        "warmup_ratio": r,
        "compile_ratio": ratio("compile_s"),
        "process_ratio": ratio("process_s"),
        "bar": BAR,
        "met": None if r is None or not cold["compiled_graphs"] else r <= BAR,
        "notes": notes,
    }


def markdown(result: dict[str, Any]) -> str:
    cold, warm, s, env = result["cold"], result["warm"], result["summary"], result["env"]
    L = [
        f"# Warm-up after a restart: {cold['model']}, {len(cold['resolutions'])} resolutions, compile=True",
        "",
        f"**Device:** {env['device_name']}; torch {env['torch']}, diffusers {env['diffusers']}; "
        f"bcg-diffusers {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}; {env['date']}  ",
        f"**Resolutions:** {', '.join(cold['resolutions'])}; size {cold['size']}  ",
        f"**Warm / cold warm-up:** {s['warmup_ratio']} (bar {s['bar']}: "
        + {True: "met", False: "not met", None: "not measured"}[s["met"]]
        + ")",
        "",
        "| process | warm-up s | compile s | capture s | graphs compiled | FX cache hit / miss | "
        "AOT cache hit / miss | build s | imports s | process s | cache after |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, d in (("first (cold)", cold), ("second (warm)", warm)):
        c = d["counters"]
        L.append(
            f"| {name} | {d['warmup_s']} | {d['compile_s']} | {d['capture_s']} | {d['compiled_graphs']} | "
            f"{c['fxgraph_cache_hit']} / {c['fxgraph_cache_miss']} | {c['autograd_cache_hit']} / "
            f"{c['autograd_cache_miss']} | {d['build_s']} | {d['imported_s']} | {d['process_s']} | "
            f"{d['cache_after']['bytes'] / 2**20:.1f} MiB |"
        )
    L += ["", "Per resolution (capture s / compile s), cold -> warm:", ""]
    L += ["| resolution | cold | warm |", "|---|--:|--:|"]
    for a, b in zip(cold["rows"], warm["rows"]):
        L.append(f"| {a['resolution']} | {a['capture_s']} / {a['compile_s']} | {b['capture_s']} / {b['compile_s']} |")
    L += [""] + [f"> {n}\n" for n in s["notes"]]
    L.append(
        "Method: scripts/bench_restart.py (each process: build, accelerate_pipeline(compile=True, "
        "compile_cache_dir=FOLDER), warmup; the folder also TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR)."
    )
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = resolve(p, p.parse_args(argv))
    if args.child:
        from benchkit.restart_child import main as child_main

        return child_main(args)
    import torch
    from benchkit.environment import collect_env

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    cold = one_process(args, "cold")
    warm = one_process(args, "warm")
    result = {"env": collect_env(torch.device(args.device)), "cold": cold, "warm": warm}
    result["summary"] = summary(cold, warm)
    (out / "restart.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "restart.md").write_text(markdown(result))
    say(f"warm / cold warm-up: {result['summary']['warmup_ratio']}; wrote {out / 'restart.json'} and restart.md")
    if args.drop_cache:
        shutil.rmtree(args.cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
