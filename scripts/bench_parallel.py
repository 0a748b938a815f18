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

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a plain checkout
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

logger = logging.getLogger("bench_parallel")

PROMPT = "an isometric cutaway of a tiny underground library lit by lanterns, with a sleeping cat"
NEGATIVE = "blurry, low quality"
SEED = 3
MODELS = ("qwen-image", "z-image")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--resolutions", nargs="+", type=int, default=[512, 1024], help="square sizes in pixels")
    p.add_argument("--size", default="full", choices=("full", "tiny"), help="model size (tiny: a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: Qwen-Image 20, Z-Image 9)")
    p.add_argument("--runs", type=int, default=3, help="timed calls per variant, after one warm-up call")
    p.add_argument("--output-type", default="latent", choices=("latent", "pil"), help="pil adds the VAE decode")
    p.add_argument("--timeout", type=float, default=600.0, help="parallel_timeout_s and the process group timeout")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run every graphs variant with compile=True (compiled blocks under the graphs), after the others",
    )
    p.add_argument(
        "--profile", action="store_true", help="one more call per variant under torch.profiler: kernel time by kind"
    )
    p.add_argument("--skip-parallel-eager", action="store_true", help="leave out the eager parallel variants")
    p.add_argument(
        "--branches-apart",
        action="store_true",
        help="also run Qwen-Image's Ulysses graph variants with cfg_batch=False (guidance calls not joined)",
    )
    p.add_argument(
        "--only", nargs="+", metavar="LABEL", help='run only these variants, e.g. "1 GPU graphs" "ulysses graphs"'
    )
    return p


# Kinds of kernel (or, without CUDA, of op) a profiled call's time is split into, first match wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d::", "all_to_all", "alltoall", "allgather", "all_gather", "allreduce")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_mha")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("copy", ("memcpy", "memset", "copy", "clone", "contiguous", "aten::cat")),
)
KIND_NAMES = (*(k for k, _ in KINDS), "other")


def kernel_kind(name: str) -> str:
    """The kind of a kernel or op, from its name."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_call(
    pipe: Any, kw: dict[str, Any], device: torch.device, together: bool, top: int = 20
) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Milliseconds of one call's kernels by kind (self CPU time of its ops without CUDA), and the
    ``top`` kernels (or ops) by time as (name, ms, count)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    if together:
        dist.barrier()
    with profile(activities=activities) as prof:
        pipe(**kw, generator=torch.Generator(device).manual_seed(SEED))
        sync(device)
    ms = dict.fromkeys(KIND_NAMES, 0.0)
    each: list[tuple[str, float, int]] = []
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # a CPU op's device time would count its kernels twice
        t = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3
        ms[kernel_kind(event.key)] += t
        each.append((event.key[:120], round(t, 3), event.count))
    if cuda:
        ms["idle"], gaps = gpu_gaps(prof.events(), top)
        each += [(f"idle after {a} / before {b}", round(t, 3), n) for (a, b), (t, n) in gaps]
    return ms, sorted(each, key=lambda e: -e[1])[:top]


def gpu_gaps(events: Any, top: int) -> tuple[float, list[tuple[tuple[str, str], tuple[float, int]]]]:
    """Milliseconds the GPU ran no kernel between the call's first and last kernel, and the
    ``top`` (kernel before, kernel after) pairs around the idle time, by total idle ms."""
    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name[:60]) for e in events if e.device_type == DeviceType.CUDA
    )
    idle = 0.0
    pairs: dict[tuple[str, str], tuple[float, int]] = {}
    end, last = None, ""
    for start, stop, name in kernels:
        if end is not None and start > end:
            gap = (start - end) / 1e3
            idle += gap
            t, n = pairs.get((last, name), (0.0, 0))
            pairs[(last, name)] = (t + gap, n + 1)
        if end is None or stop >= end:
            end, last = stop, name
    return idle, sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]


def settings(model: str, steps: int | None) -> dict[str, Any]:
    if model == "qwen-image":
        return dict(negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=steps or 20)
    return dict(guidance_scale=0.0, num_inference_steps=steps or 9)


def variants(
    model: str, world: int, compile: bool = False, parallel_eager: bool = True, apart: bool = False
) -> list[tuple[str, str | None, str, bool]]:
    """(label, parallel, mode, cfg_batch) in the order they run; compiled variants last (mode
    ``bcg+compile``); with ``apart``, Qwen-Image's Ulysses graph variants also with cfg_batch off."""
    layouts = []
    if model == "qwen-image":  # Z-Image batches its guidance branches into one call
        if world == 2:
            layouts.append("cfg")
        elif world % 2 == 0:
            layouts.append("cfg+ulysses")
    layouts.append("ulysses")
    apart = apart and model == "qwen-image"
    out: list[tuple[str, str | None, str, bool]] = [
        ("1 GPU eager", None, "eager", True),
        ("1 GPU graphs", None, "bcg", True),
    ]
    for parallel in layouts:
        out += [(f"{parallel} eager", parallel, "eager", True)] if parallel_eager else []
        out += [(f"{parallel} graphs", parallel, "bcg", True)]
        if apart and parallel == "ulysses":
            out += [(f"{parallel} graphs, branches apart", parallel, "bcg", False)]
    if compile:
        out += [("1 GPU graphs+compile", None, "bcg+compile", True)]
        for parallel in layouts:
            out += [(f"{parallel} graphs+compile", parallel, "bcg+compile", True)]
            if apart and parallel == "ulysses":
                out += [(f"{parallel} graphs+compile, branches apart", parallel, "bcg+compile", False)]
    return out


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_calls(
    pipe: Any, kw: dict[str, Any], runs: int, device: torch.device, together: bool
) -> tuple[list[float], Any]:
    """One warm-up call, then ``runs`` timed calls; every rank calls when ``together``. Returns
    the times and the last call's output (:func:`as_tensor`)."""
    times, out = [], None
    for i in range(runs + 1):
        sync(device)
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        out = pipe(**kw, generator=torch.Generator(device).manual_seed(SEED)).images
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return times, as_tensor(out)


def as_tensor(images: Any) -> torch.Tensor:
    """A call's output as one float tensor on the CPU: latents as they are, PIL images as pixels."""
    if isinstance(images, torch.Tensor):
        return images.float().cpu()
    import numpy as np

    return torch.from_numpy(np.stack([np.asarray(im) for im in images])).float()


def run_variant(
    pipe: Any,
    model: str,
    res: int,
    label: str,
    parallel: str | None,
    mode: str,
    args: argparse.Namespace,
    ctx: dict,
    cfg_batch: bool = True,
) -> dict[str, Any] | None:
    from accel import accelerate_pipeline

    rank, device = ctx["rank"], ctx["device"]
    together = parallel is not None
    if not together and rank != 0:
        return None  # rank 0 alone; the others wait at the barrier after this variant
    kw = dict(prompt=PROMPT, height=res, width=res, output_type=args.output_type, **settings(model, args.steps))
    row: dict[str, Any] = dict(model=model, resolution=res, variant=label, parallel=parallel, mode=mode)
    accelerated = parallel is not None or mode != "eager"
    try:
        if accelerated:
            compiled = mode == "bcg+compile"
            accelerate_pipeline(
                pipe,
                mode="bcg" if compiled else mode,
                compile=compiled,
                parallel=parallel,
                parallel_timeout_s=args.timeout,
                cfg_batch=cfg_batch,
            )
            if mode != "eager":
                t0 = time.perf_counter()
                neg = kw.get("negative_prompt")
                pipe.accel.warmup(
                    [(res, res)], prompts=[PROMPT], negative_prompt=neg, cfg=neg is not None, progress=False
                )
                row["warmup_s"] = time.perf_counter() - t0
        times, latents = timed_calls(pipe, kw, args.runs, device, together)
        row.update(median_s=statistics.median(times), times_s=times, status="ok")
        if args.profile:
            row["profile_ms"], row["profile_top"] = profile_call(pipe, kw, device, together)
        if accelerated:
            stats = pipe.accel.stats()["transformer"]
            row.update(replays=stats.replays, eager_calls=stats.eager_calls, captures=stats.captures)
            row["joined_pairs"] = pipe.accel.guidance_batches().get("transformer", (0, 0))[0]
        row["_latents"] = latents
    except Exception as exc:  # a failed variant is a row, not a lost run
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        logger.warning("%s %s %s: %s", model, res, label, row["error"])
    finally:
        if "accel" in pipe.__dict__:
            pipe.accel.restore()
    return row


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
        f"output_type={config['output_type']}; steps: Qwen-Image {settings('qwen-image', config['steps'])['num_inference_steps']} "
        f"(true CFG), Z-Image {settings('z-image', config['steps'])['num_inference_steps']} (no guidance)",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if "RANK" not in os.environ:
        raise SystemExit("start this with torchrun --nproc_per_node N (N >= 2)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # CPU smoke runs only: diffusers' enable_parallelism picks a device as rank % accelerator
        # count, which is 0 on a CPU-only machine.
        torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("start this with torchrun --nproc_per_node N (N >= 2)")
    from pipelines.builders import build_pipeline

    ctx = dict(rank=rank, device=device)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows: list[dict[str, Any]] = []
    for model in args.models:
        t0 = time.perf_counter()
        pipe = build_pipeline(model, args.size, device=device, dtype=dtype, seed=0)
        pipe.set_progress_bar_config(disable=True)
        if rank == 0:
            print(f"built {model} ({args.size}) in {time.perf_counter() - t0:.0f}s", flush=True)
        for res in args.resolutions:
            refs: dict[str, torch.Tensor] = {}
            planned = variants(model, world, args.compile, not args.skip_parallel_eager, args.branches_apart)
            for label, parallel, mode, cfg_batch in planned:
                if args.only and label not in args.only:
                    continue
                row = run_variant(pipe, model, res, label, parallel, mode, args, ctx, cfg_batch)
                dist.barrier()
                if row is None:
                    continue
                latents = row.pop("_latents", None)
                if latents is not None and parallel is None:
                    refs[mode] = latents
                elif latents is not None and mode in refs:
                    ref = refs[mode]
                    row["diff"] = ((latents - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                if rank == 0:
                    rows.append(row)
                    print(
                        f"{model} {res} {label}: {row.get('median_s', float('nan')):.3f}s {row['status']}", flush=True
                    )
        del pipe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        env = environment(device, world)
        config = dict(vars(args), dtype=str(dtype).removeprefix("torch."))
        print(write(Path(args.out), env, config, rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # releases any graph still alive first (accel.parallel's wrap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
