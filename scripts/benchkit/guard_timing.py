"""The host time of the state guard's per-call check (scripts/bench_guard.py): each part timed over
interleaved rounds on a transformer built on the meta device with the library's graph hook."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accel import AcceleratorOptions
from accel.hooks import HOOK_NAME, apply_graph_runner, remove_graph_runner
from accel.hooks.caches import find_caches
from accel.hooks.state import offload_reason, weights_fingerprint
from pipelines.builders import build_transformer

from .environment import collect_env
from .settings import say

PARTS = ("weights", "state", "together", "cold", "follow", "before")
# Larger than the last-level cache of the machines this runs on: written before the "cold" part,
# as a pipeline call between two checks would.
_EVICT_BYTES = 64 << 20


class _Owner:
    """Stands for the pipeline that uses the hook (hooks count their users weakly)."""


def _quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the collector off, as the follower runs its check."""

    def run() -> Any:
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()

    return run


def measure(name: str, size: str, calls: int, warmup: int) -> dict[str, Any]:
    module = build_transformer(name, size, device="meta")
    owner = _Owner()
    hook = apply_graph_runner(module, AcceleratorOptions(), name="transformer", user=owner, pool=None)
    try:
        hook.follow_weights()  # the look after the hook's registration, as a first call makes
        watch = hook.follower.watch
        assert watch is not None and watch.unchanged(), "the check must see nothing changed on an unchanged module"
        evict = torch.empty(_EVICT_BYTES // 4)
        timed: dict[str, Callable[[], Any]] = {
            "weights": _quiet(watch.weights_unchanged),
            "state": _quiet(watch.state_unchanged),
            "together": _quiet(watch.unchanged),
            "cold": _quiet(watch.unchanged),
            "follow": hook.follow_weights,
            "before": lambda: (weights_fingerprint(module), offload_reason(module), find_caches(module, HOOK_NAME)),
        }
        for _ in range(warmup):
            for fn in timed.values():
                fn()
        # Wall time, and the thread's CPU time (on a shared machine the wall time also counts the
        # time other processes held the core).
        samples: dict[str, list[float]] = {k: [] for k in timed}
        cpu: dict[str, list[float]] = {k: [] for k in timed}
        for _ in range(calls):
            for key, fn in timed.items():
                if key == "cold":
                    evict.add_(1.0)
                start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
                fn()
                cpu[key].append((time.thread_time_ns() - start_cpu) / 1e6)
                samples[key].append((time.perf_counter_ns() - start) / 1e6)
        looks = []
        for _ in range(max(1, min(5, calls))):
            start = time.perf_counter_ns()
            watch.look()
            looks.append((time.perf_counter_ns() - start) / 1e6)
        row: dict[str, Any] = {
            "model": name,
            "size": size,
            "modules": sum(1 for _ in module.modules()),
            "watched_dicts": watch.watched_dicts,
            "tensors": watch.watched_tensors,
            "calls": calls,
        }
        for key, values in samples.items():
            row[f"{key}_ms"] = statistics.median(values)
            row[f"{key}_p90_ms"] = statistics.quantiles(values, n=10)[-1] if len(values) >= 10 else max(values)
            row[f"{key}_cpu_ms"] = statistics.median(cpu[key])
            row[f"{key}_min_ms"] = min(values)
        row["look_ms"] = statistics.median(looks)
        return row
    finally:
        remove_graph_runner(module, owner)


def table(rows: list[dict[str, Any]]) -> str:
    """Medians of wall time (the thread's CPU time, then the fastest round, in brackets), in ms."""
    head = "| model | modules | watched dicts | tensors | weights | state | together | cold | follow() | before | one look |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['size']}) | {r['modules']} | {r['watched_dicts']} | {r['tensors']} | "
            + " | ".join(f"{r[f'{k}_ms']:.3f} ({r[f'{k}_cpu_ms']:.3f}, {r[f'{k}_min_ms']:.3f})" for k in PARTS)
            + f" | {r['look_ms']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default="qwen-image,z-image", help="comma-separated embedded model names")
    p.add_argument("--size", default="full", choices=("tiny", "full"))
    p.add_argument("--calls", type=int, default=500, help="timed rounds per model")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=None, help="folder for guard.json and guard.md")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be at least 1")
    return args


def run(args: argparse.Namespace) -> int:
    """Every model of ``args``: the table printed, guard.json and guard.md under ``--out``."""
    torch.set_num_threads(1)  # the check is one thread; so is the buffer that evicts the caches
    env = collect_env(torch.device("cpu"))
    env["load_average_before"] = os.getloadavg()
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        say(f"{name} ({args.size}): {args.calls} rounds")
        rows.append(measure(name, args.size, args.calls, args.warmup))
    env["load_average_after"] = os.getloadavg()
    text = table(rows)
    print(text)
    print(
        f"ms, medians over {args.calls} rounds, wall (thread CPU); load average {env['load_average_before']} -> {env['load_average_after']}"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "guard.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2, default=str))
        (out / "guard.md").write_text(text + "\n")
    return 0
