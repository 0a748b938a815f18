"""The command line of scripts/bench_parallel.py and its run on every rank: each model built once,
every variant per resolution, its distance to the one-GPU run; rank 0 writes the results."""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .parallel_calls import run_variant, variants
from .parallel_report import environment, write

MODELS = ("qwen-image", "z-image")


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
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


def run(args: argparse.Namespace) -> int:
    """The run of this rank (every rank of the launch runs it)."""
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
