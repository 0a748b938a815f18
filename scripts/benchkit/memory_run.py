"""The command line of scripts/bench_memory.py and its run: per model, in one process, the peak
reserved memory of eager calls at the warmed sizes, then of graph calls after warming them,
without and with ``compile=True``; results.json and results.md after every row."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .calls import register_recipes, warm_up
from .environment import collect_env
from .measure import drop_compiled
from .rows import failed
from .settings import call_kwargs, parse_resolution, res_name
from .settings import say_clock as say

MODELS = ("qwen-image", "z-image")
VARIANTS = ("eager", "graphs", "graphs-compiled")
# The sizes of the bars, largest first.
SIZES = {
    "qwen-image": ((1328, 1328), (1024, 1024), (512, 512)),
    "z-image": ((1536, 864), (1024, 1024), (512, 512)),
}
TINY_SIZES = ((64, 64), (32, 32))
GiB = 2**30


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--only", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--resolutions", nargs="+", type=parse_resolution, default=None, help="default: the bars' sizes")
    p.add_argument("--steps", type=int, default=2, help="steps per call (memory does not depend on it)")
    p.add_argument("--compile-cache", default=None, help="inductor's cache folder (default: a fresh one, cold)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    return args


def _memory(device: torch.device) -> dict[str, float] | None:
    """The device's peaks since the window began, and what it holds now, in GiB."""
    if device.type != "cuda":
        return None
    from accel import peak_memory

    allocated, reserved = peak_memory(device)
    return {
        "peak_reserved_gib": round(reserved / GiB, 3),
        "peak_allocated_gib": round(allocated / GiB, 3),
        "reserved_gib": round(torch.cuda.memory_reserved(device) / GiB, 3),
    }


def _window(device: torch.device, empty: bool = True) -> None:
    """Start a new peak window: with ``empty``, from a cache given back first."""
    if device.type != "cuda":
        return
    from accel import reset_peak_memory

    torch.cuda.synchronize(device)
    if empty:
        torch.cuda.empty_cache()
    reset_peak_memory(device)


class MemoryBench:
    """One model: its pipeline and one row per variant."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args, self.model = args, model
        self.cuda = torch.cuda.is_available() and args.size == "full"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        sizes = args.resolutions or (SIZES[model] if args.size == "full" else TINY_SIZES)
        self.sizes = sorted(sizes, key=lambda wh: (wh[0] * wh[1], wh[0]), reverse=True)
        self.pipe: Any = None
        self.eager: dict[str, float] | None = None

    def build(self) -> None:
        from pipelines.builders import build_pipeline

        say(f"building {self.model} ({self.args.size}) on {self.device}")
        self.pipe = build_pipeline(self.model, self.args.size, device=self.device, dtype=torch.bfloat16, seed=0)
        self.pipe.set_progress_bar_config(disable=True)

    def close(self) -> None:
        self.pipe = None
        drop_compiled(self.cuda)

    def _calls(self) -> list[dict[str, Any]]:
        """One decoded call per size, largest first; their peaks after each size."""
        per_size = []
        for wh in self.sizes:
            t0 = time.perf_counter()
            kwargs = call_kwargs(self.model, wh, self.args.steps)
            self.pipe(**kwargs, generator=torch.Generator(self.device).manual_seed(0), output_type="pil")
            if self.cuda:
                torch.cuda.synchronize(self.device)
            per_size.append({"resolution": res_name(wh), "seconds": round(time.perf_counter() - t0, 2)})
            per_size[-1].update(_memory(self.device) or {})
        return per_size

    def run(self, variant: str) -> dict[str, Any]:
        row: dict[str, Any] = {"model": self.model, "variant": variant, "sizes": [res_name(wh) for wh in self.sizes]}
        t0 = time.perf_counter()
        try:
            if variant == "eager":
                _window(self.device)
                row["weights_gib"] = round(torch.cuda.memory_allocated(self.device) / GiB, 3) if self.cuda else None
                row["calls"] = self._calls()
                row["memory"] = _memory(self.device)
                self.eager = row["memory"]
            else:
                row.update(self._graphs(compiled=variant == "graphs-compiled"))
            row["status"] = "ok"
        except Exception as exc:
            failed(row, exc)
        finally:
            if "accel" in vars(self.pipe):
                self.pipe.accel.restore()
            torch._dynamo.reset()
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        say(json.dumps({k: v for k, v in row.items() if k not in ("warmup", "report")}))
        return row

    def _graphs(self, compiled: bool) -> dict[str, Any]:
        from accel import accelerate_pipeline

        qwen = self.model == "qwen-image"
        options: dict[str, Any] = {"compile": compiled}
        if compiled:
            options["compile_cache_dir"] = self.args.compile_cache or tempfile.mkdtemp(prefix="bcg-memory-compile-")
        _window(self.device)
        t0 = time.perf_counter()
        accelerate_pipeline(self.pipe, **options)
        report = warm_up(self.pipe, self.sizes, qwen)
        out: dict[str, Any] = {"setup_s": round(time.perf_counter() - t0, 2), "warmup_memory": _memory(self.device)}
        _window(self.device, empty=False)  # the calls' window: what the warm-up left stays
        before = {n: s.eager_calls for n, s in self.pipe.accel.stats().items()}
        out["calls"] = self._calls()
        out["memory"] = _memory(self.device)
        stats = self.pipe.accel.stats()
        out["eager_calls"] = {n: s.eager_calls - before.get(n, 0) for n, s in stats.items()}
        out["graph_mib"] = round(self.pipe.accel.graph_memory_bytes() / 2**20, 1) if self.cuda else 0.0
        out["warmup"] = str(report)
        out["rows"] = [
            {
                "resolution": r.size,
                "graph_mib": round(r.resident_bytes / 2**20, 1),
                "eager_peak_mib": round(r.eager_peak_bytes / 2**20, 1),
                "decoder": None if r.decoder is None else _decoder(r.decoder),
            }
            for r in report.rows
        ]
        if self.eager and out["memory"]:
            out["vs_eager"] = round(out["memory"]["peak_reserved_gib"] / self.eager["peak_reserved_gib"], 4)
            out["warmup_vs_eager"] = round(
                out["warmup_memory"]["peak_reserved_gib"] / self.eager["peak_reserved_gib"], 4
            )
        out["report"] = self.pipe.accel.report()
        return out


def _decoder(t: Any) -> dict[str, Any]:
    """The decoder trial's measurements at one size and its verdict (accel/hooks/images/decoder_verdict.py)."""
    return {
        "graph_ms": t.graph_ms,
        "eager_ms": t.eager_ms,
        "noise_ms": t.noise_ms,
        "kept": t.kept,
        "verdict": t.verdict,
        "why": t.why,
        "graph_pool_mib": round(t.graph_bytes / 2**20, 1),
        "held_mib": round(t.held_bytes / 2**20, 1),
        "replay_copies_mib": round(t.replay_bytes / 2**20, 1),
        "eager_decode_mib": round(t.eager_bytes / 2**20, 1),
    }


def _per_call(rows: list[dict[str, Any]]) -> list[str]:
    """Peak reserved after each call, and the decoder's trial per size: where a peak rises, and why."""
    lines = [
        "",
        "Peak reserved (GiB) after each call, in order; per size the decoder's verdict, its graphs' pool, "
        "a replay's copies out and the eager decode's transient (MiB):",
        "",
        "| model | variant | size | peak after the call | decoder | graphs pool | replay copies | eager decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decoders = {d["resolution"]: d.get("decoder") for d in r.get("rows", [])}
        for c in r.get("calls", []):
            d = decoders.get(c["resolution"]) or {}
            lines.append(
                f"| {r['model']} | {r['variant']} | {c['resolution']} | {c.get('peak_reserved_gib', '')} | "
                f"{d.get('verdict', '')} | {d.get('graph_pool_mib', '')} | {d.get('replay_copies_mib', '')} | "
                f"{d.get('eager_decode_mib', '')} |"
            )
    return lines


def markdown(env: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}, commit {env['git_commit']}"
        f"{' (dirty)' if env['git_dirty'] else ''}, {env['date']}; full-size random weights, bf16, decoded calls, "
        "one process; peak reserved memory (GiB) of one call per size, largest first",
        "",
        "| model | variant | sizes | weights | peak reserved | x eager | warm-up peak | x eager | graph MiB "
        "| setup s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, w = r.get("memory") or {}, r.get("warmup_memory") or {}
        lines.append(
            f"| {r['model']} | {r['variant']} | {' '.join(r['sizes'])} | {r.get('weights_gib', '')} | "
            f"{m.get('peak_reserved_gib', '')} | {r.get('vs_eager', '')} | {w.get('peak_reserved_gib', '')} | "
            f"{r.get('warmup_vs_eager', '')} | {r.get('graph_mib', '')} | {r.get('setup_s', '')} | "
            f"{r['status']} {r.get('reason', '')} |"
        )
    lines += _per_call(rows)
    for r in rows:
        if r.get("warmup"):
            lines += ["", f"{r['model']} {r['variant']}, warm-up:", "", "```", r["warmup"], "```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    """Every model of ``args``, one after the other in this process; the last table printed."""
    register_recipes()
    device = torch.device("cuda" if torch.cuda.is_available() and args.size == "full" else "cpu")
    env = collect_env(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    md = ""
    for model in args.only:
        bench = MemoryBench(args, model)
        bench.build()
        # Eager first, always: its peak is the bar, measured before any graph exists in the process.
        for variant in ("eager", *(v for v in args.variants if v != "eager")):
            rows.append(bench.run(variant))
            (out / "results.json").write_text(json.dumps({"env": env, "args": vars(args), "rows": rows}, indent=1))
            md = markdown(env, rows)
            (out / "results.md").write_text(md)
        with contextlib.suppress(Exception):
            bench.close()
    print(md)
