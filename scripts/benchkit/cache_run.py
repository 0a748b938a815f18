"""The command line of scripts/bench_caches.py and its run: every variant at every resolution on
one pipeline, results.json and results.md after each."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from .cache_bench import Bench, parse_variant
from .calls import register_recipes
from .environment import collect_env
from .settings import parse_resolution, res_name


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{args.model} ({args.size}), {env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}, "
        f"cache-dit {env.get('cache_dit')}, commit {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}, "
        f"{env['date']}; end to end (PIL), median of {args.runs}",
        "",
        "| variant | res | s | x eager | setup s | cached | step ms computed / cached | diff | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {r["resolution"]: r.get("seconds") for r in rows if r["variant"] == "eager"}
    for r in rows:
        s = r.get("seconds")
        base = eager.get(r["resolution"])
        x = f"{base / s:.2f}" if s and base else ""
        step = r.get("step_ms") or {}
        diff = r.get("diff_vs_compiled_eager", r.get("diff", r.get("diff_vs_eager", "")))
        lines.append(
            f"| {r['variant']} | {r['resolution']} | {s or ''} | {x} | {r.get('setup_s', '')} | {r.get('cached', '')} | "
            f"{step.get('computed', '')} / {step.get('cached', '')} | {diff} | {r['status']} {r.get('reason', '')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=("qwen-image", "z-image"), default="qwen-image")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--resolutions", nargs="+", type=parse_resolution, default=[(1024, 1024)])
    p.add_argument(
        "--variants",
        nargs="+",
        type=str,
        default=["eager", "bcg-compile", "dbcache", "dbcache+bcg", "dbcache+bcg-compile"],
    )
    p.add_argument("--steps", type=int, default=None, help="default: 20 (Qwen-Image), 9 (Z-Image)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of each warm-up call")
    p.add_argument("--dbcache-threshold", type=float, default=100.0)
    p.add_argument("--fbc-threshold", type=float, default=10.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for v in args.variants:
        parse_variant(v)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    return args


def run(args: argparse.Namespace) -> None:
    """Every variant of ``args`` at every resolution; the last table printed."""
    register_recipes()
    bench = Bench(args)
    env = collect_env(bench.device)
    with contextlib.suppress(Exception):
        import importlib.metadata

        env["cache_dit"] = importlib.metadata.version("cache-dit")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown = vars(args) | {"resolutions": [res_name(r) for r in args.resolutions]}
    rows: list[dict[str, Any]] = []
    md = ""
    for wh in args.resolutions:
        for v in args.variants:
            rows.append(bench.run(v, wh))
            # Written after every variant: a run cut off by a time limit keeps what it measured.
            (out / "results.json").write_text(
                json.dumps({"env": env, "args": shown, "rows": rows}, indent=1, default=str)
            )
            md = markdown(env, args, rows)
            (out / "results.md").write_text(md)
    print(md)
