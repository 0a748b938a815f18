"""The outputs of scripts/bench_parallel.py: the device and versions, the latency and profile
tables, results.json and results.md."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from . import parallel_calls
from .parallel_profile import KIND_NAMES
from .settings import ROOT


def environment(device: torch.device, world: int) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*cmd: str) -> str | None:
        with contextlib.suppress(Exception):
            out = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=20, cwd=ROOT)
            return out.stdout.strip() if out.returncode == 0 else None
        return None

    env: dict[str, Any] = {
        "device": device.type,
        "device_name": platform.processor() or platform.machine(),
        "processes": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "diffusers": version("diffusers"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=torch.cuda.get_device_name(device), device_memory_gib=round(props.total_memory / 2**30))
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | resolution | variant | latency s | vs 1 GPU eager | vs 1 GPU graphs | vs 1 GPU graphs+compile "
        "| warm-up s | diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["status"] == "ok" and r["parallel"] is None:
            base.setdefault((r["model"], r["resolution"]), {})[r["mode"]] = r["median_s"]
    for r in rows:
        b = base.get((r["model"], r["resolution"]), {})
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['resolution']} | {r['variant']} | error: {r['error']} | | | | | |")
            continue
        speedup = {k: f"{v / r['median_s']:.2f}x" for k, v in b.items()}
        warm = f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-"
        diff = "-" if r.get("diff") is None else ("0 (exact)" if r["diff"] == 0 else f"{r['diff']:.1e}")
        lines.append(
            f"| {r['model']} | {r['resolution']} | {r['variant']} | {r['median_s']:.3f} | {speedup.get('eager', '-')} | "
            f"{speedup.get('bcg', '-')} | {speedup.get('bcg+compile', '-')} | {warm} | {diff} |"
        )
    return lines


def profile_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | resolution | variant | " + " | ".join(KIND_NAMES) + " | sum | GPU idle |",
        "|---|---|---|" + "---|" * (len(KIND_NAMES) + 2),
    ]
    for r in rows:
        if "profile_ms" in r:
            ms = r["profile_ms"]
            cells = " | ".join(f"{ms[k]:.1f}" for k in KIND_NAMES)
            busy = sum(ms[k] for k in KIND_NAMES)
            idle = f"{ms['idle']:.1f}" if "idle" in ms else "-"
            lines.append(f"| {r['model']} | {r['resolution']} | {r['variant']} | {cells} | {busy:.1f} | {idle} |")
    return lines


def write(out: Path, env: dict[str, Any], config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(env=env, config=config, rows=rows), indent=1))
    md = [
        "# One image on several GPUs",
        "",
        f"**Device:** {env['processes']} x {env['device_name']} ({env['device']}"
        + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if env["device"] == "cuda" else "")
        + ")  ",
        f"**Versions:** torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
        f"python {env['python']}; bcg-diffusers {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}  ",
        f"**Run:** {env['date']}; {config['size']} models, {config['dtype']}; median of {config['runs']} calls after 1 warm-up; "
        f"output_type={config['output_type']}; steps: Qwen-Image {parallel_calls.settings('qwen-image', config['steps'])['num_inference_steps']} "
        f"(true CFG), Z-Image {parallel_calls.settings('z-image', config['steps'])['num_inference_steps']} (no guidance)",
        "",
        "Latency = one pipeline call on rank 0, barrier to last kernel. diff = largest difference of the final "
        + ("pixels" if config["output_type"] == "pil" else "latents")
        + " from the one-GPU run of the same mode, relative to the largest "
        + ("pixel value." if config["output_type"] == "pil" else "latent."),
        "",
        *table(rows),
        "",
    ]
    if any("profile_ms" in r for r in rows):
        md += [
            f"{'Kernel' if env['device'] == 'cuda' else 'Op (self CPU)'} time of one profiled call on rank 0, ms, by kind "
            "(`--profile`; the profiler slows the host, so the sum and the latency above differ):",
            "",
            *profile_table(rows),
            "",
        ]
    text = "\n".join(md)
    (out / "results.md").write_text(text)
    return text
