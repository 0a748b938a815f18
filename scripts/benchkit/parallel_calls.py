"""The calls of scripts/bench_parallel.py: its variants (one GPU, cfg, ulysses, eager, graphs,
compiled) and one variant on every rank: accelerated, warmed up, timed, profiled."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from .parallel_profile import KIND_NAMES, gpu_gaps, kernel_kind

logger = logging.getLogger("bench_parallel")

PROMPT = "an isometric cutaway of a tiny underground library lit by lanterns, with a sleeping cat"
NEGATIVE = "blurry, low quality"
SEED = 3


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
