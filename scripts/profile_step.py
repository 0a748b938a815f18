#!/usr/bin/env python
"""Per-kernel profile of one denoising step, compiled and replayed as CUDA graphs: GPU time by kind.

The pipeline is set up the way a user would: ``build_pipeline(model, size)``, then
``accelerate_pipeline(pipe, compile=...)`` and ``pipe.accel.warmup([resolution], ...)`` (Z-Image as
Turbo: guidance 0; Qwen-Image with true CFG and a negative prompt). One real pipeline call then
records, with a forward pre-hook, the denoiser calls of its step 0 (one for Z-Image, two for
Qwen-Image: the conditional and the unconditional branch). A *step* below is those calls.

What is profiled: the step's denoiser calls made directly, ``pipe.transformer(...)`` (through the
graph hook into the runner's replay: the graphs a pipeline call replays), not whole pipeline calls.
That way a step's window holds the denoiser's work only (no text encoder, scheduler or VAE
between steps) and ends with a synchronisation, so windows do not overlap and every kernel
belongs to one step. ``--warmup-calls`` untimed steps come first, then ``--steps`` steps timed
without the profiler (CUDA events: the step time), then one profiler session: one settling step
(left out: the first records of a session can be lost or mistimed), then ``--steps`` profiled
steps, each inside a ``record_function`` window.

How: ``torch.profiler`` with CPU and CUDA activity. CUPTI's kernel records include kernels
launched by a graph replay (``cudaGraphLaunch``) with their own names and device timestamps; no
``_ExperimentalConfig`` flag is needed for that. Two hazards are known with graphs in the
process, and avoided: tearing CUPTI down after a session and re-initialising it lazily has
crashed with CUDA graphs (torch turns both off for its own cudagraphs on CUDA < 12.6; this script
sets ``TEARDOWN_CUPTI=0`` and ``DISABLE_CUPTI_LAZY_REINIT=1`` unless they are set), and the first
records of a session can carry wrong timestamps: one profiling session per process, a settling
step, and events outside every step window counted (``unassigned``) and left out. Kernel launches
are attributed by time, not by correlation id (a replay's kernels all correlate to one
``cudaGraphLaunch``).

Fallback, ``--no-graphs``: the same accelerated (and compiled) pipeline with its graphs released
and the runners switched off, so the step runs the recipe-prepared forward over the same compiled
blocks, launching kernel by kernel: the same kernels, plus the launch gaps graphs remove. The
profiler's CPU-side recording adds host time per op there, so its idle time is an upper bound.

Per kernel name: count, total, kind (``scripts/benchkit/kernels.py``: GEMM, attention,
norm/elementwise split into norm, activation, rope, elementwise, copies/casts, other). Per kind:
ms per step and share of the step's wall time; idle = the step window minus the union of the
device's busy intervals, with the part between the first and the last kernel apart.

Outputs under ``--out``: profile.json, profile.md (a table by kind, the top ``--top`` kernels, ms
per step), trace.json with ``--trace`` (Chrome trace; large). Device, versions, date and commit
are in both.

    python scripts/profile_step.py --model z-image --out out/profile/z-image        # GPU: full, compiled, graphs
    python scripts/profile_step.py --model qwen-image --no-graphs --out out/profile/qwen-nographs
    python scripts/profile_step.py --model z-image --size tiny --no-compile --resolution 64x64 \\
        --steps 2 --out /tmp/profile                                                 # CPU: CPU ops only

On a CPU the profiler records CPU ops only: the files are written and say that no CUDA kernel was
recorded. Full sizes need a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):  # runnable from a plain checkout, without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Kineto reads these when a session starts and ends: CUPTI stays up for the whole process, as torch
# arranges for its own cudagraphs (a teardown and lazy re-init under CUDA graphs has crashed).
os.environ.setdefault("TEARDOWN_CUPTI", "0")
os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")

import torch  # noqa: E402
from benchkit.kernels import DESCRIPTIONS, KINDS, DeviceEvent, summarize  # noqa: E402
from benchkit.settings import NEGATIVE, PROMPT, SEED, parse_resolution, res_name, say, uses_cfg  # noqa: E402

MODELS = ("z-image", "qwen-image", "flux")
STEP_LABEL = "profile_step/"
SETTLE_LABEL = "profile_step/settle"
# Device-side records that are not work: the GPU side of record_function ranges, synchronisations.
# Everything else on the CUDA device counts (kineto's "kernel", "gpu_memcpy", "gpu_memset").
NOT_WORK = ("annotation", "sync")
# pipe_kwargs' steps for Qwen-Image: only step 0 runs, so the count changes no call's shapes.
_RECORD_ARGS = argparse.Namespace(steps_e2e=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Per-kernel profile of one compiled, graph-captured denoising step: GPU time by kind.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument(
        "--resolution", type=parse_resolution, default=(1024, 1024), help="WxH (width x height), default 1024x1024"
    )
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="accelerate_pipeline(compile=True): inductor's kernels inside the graphs (CUDA only; default on)",
    )
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the captured graphs (default); --no-graphs: the same step launched kernel by kernel",
    )
    p.add_argument("--steps", type=int, default=5, help="profiled steps (each: the denoiser calls of one step)")
    p.add_argument("--warmup-calls", type=int, default=2, help="untimed steps before timing (default 2)")
    p.add_argument("--top", type=int, default=25, help="kernels listed in profile.md (default 25)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace (trace.json)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument(
        "--compile-cache", metavar="DIR", default=None, help="compile_cache_dir of accelerate_pipeline (default: its)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's info messages")
    return p


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the device; bad values end in one line (exit status 2)."""
    for name, low in (("steps", 1), ("warmup_calls", 0), ("top", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    cuda = torch.cuda.is_available()
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    if args.device == "cuda" and not cuda:
        p.error("--device cuda: CUDA is not available here")
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    if args.size == "full" and args.device != "cuda":
        p.error("--size full needs a CUDA device (use --size tiny on a CPU)")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


# -- the pipeline, set up as a user would ---------------------------------------------------------
def setup(args: argparse.Namespace, device: torch.device) -> tuple[Any, list[tuple[tuple, dict]], dict[str, Any]]:
    """The accelerated, warmed-up pipeline, step 0's recorded denoiser calls and the setup's costs."""
    from benchkit.calls import accelerate, compiled_blocks, record_step0_calls, register_recipes

    from pipelines.builders import build_pipeline, describe

    register_recipes()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    pipe = build_pipeline(args.model, size=args.size, device=device, dtype=dtype, seed=SEED)
    pipe.set_progress_bar_config(disable=True)
    build_s = time.perf_counter() - t0
    say(f"built {describe(pipe)} in {build_s:.1f} s")
    accelerate(pipe, compile=args.compile, compile_cache_dir=args.compile_cache)
    cfg = uses_cfg(args.model)
    t0 = time.perf_counter()
    with torch.no_grad():
        report = pipe.accel.warmup(
            [args.resolution], prompts=[PROMPT], negative_prompt=NEGATIVE if cfg else None, cfg=cfg, progress=False
        )
    warmup_s = time.perf_counter() - t0
    say(f"warm-up in {warmup_s:.1f} s: {report.total_captures} graph(s), compile {report.total_compile_seconds:.1f} s")
    calls = record_step0_calls(pipe, args.model, args.resolution, _RECORD_ARGS, device)
    costs = {
        "describe": describe(pipe),
        "build_s": round(build_s, 2),
        "warmup_s": round(warmup_s, 2),
        "compile_s": round(report.total_compile_seconds, 2),
        "captures": report.total_captures,
        "graph_mb": round(pipe.accel.graph_memory_bytes() / 2**20, 1),
        "compiled_blocks": len(compiled_blocks(pipe.transformer)),
        "warmup_skipped": report.skipped,
    }
    return pipe, calls, costs


@contextlib.contextmanager
def graphs_off(accel: Any) -> Iterator[None]:
    """The pipeline's calls run eagerly over the same (compiled) blocks: graphs released, runners off."""
    from accel.hooks.warmup import uncaptured

    accel.release()
    with uncaptured(accel.runners.values()):
        yield


# -- the profiler's records -------------------------------------------------------------------
# CUPTI's synchronisation records on the device timeline (not work), by name, for a torch whose
# events do not say their activity type (torch 2.11's _KinetoEvent has no activity_type()).
_SYNC_NAMES = ("Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event")


def _activity(e: Any) -> str:
    """The kineto activity type of a profiler event ("kernel", "gpu_memcpy", "gpu_user_annotation", ...)."""
    method = getattr(e, "activity_type", None)
    if method is not None:
        return method()
    if getattr(e, "is_user_annotation", lambda: False)() or e.name().startswith(STEP_LABEL):
        return "gpu_user_annotation"
    if e.device_type() == torch.autograd.DeviceType.CPU:
        return "cpu_op"
    name = e.name()
    if name in _SYNC_NAMES:
        return "cuda_sync"
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"


def timeline(prof: Any) -> tuple[list[DeviceEvent], list[tuple[int, int]], dict[str, int]]:
    """(device events outside the settling step, the profiled steps' windows in order, counts)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = list(prof.profiler.kineto_results.events())
    steps: dict[int, tuple[int, int]] = {}
    settle: tuple[int, int] | None = None
    for e in events:
        name = e.name()
        if e.device_type() == cpu and name.startswith(STEP_LABEL):
            if name == SETTLE_LABEL:
                settle = (e.start_ns(), e.end_ns())
            else:
                steps[int(name[len(STEP_LABEL) :])] = (e.start_ns(), e.end_ns())
    activities = Counter(_activity(e) for e in events if e.device_type() == cuda)
    device = [
        DeviceEvent(e.name(), e.start_ns(), e.end_ns())
        for e in events
        if e.device_type() == cuda and not any(w in _activity(e) for w in NOT_WORK)
    ]
    settled = [ev for ev in device if settle is None or not settle[0] <= ev.start_ns < settle[1]]
    counts = {
        "cpu_ops": sum(1 for e in events if e.device_type() == cpu and _activity(e) == "cpu_op"),
        "device_events": len(device),
        "settle_events": len(device) - len(settled),
        **{f"activity:{k}": v for k, v in sorted(activities.items())},
    }
    return settled, [steps[i] for i in sorted(steps)], counts


def profile(
    args: argparse.Namespace, step: Callable[[], None], clock: Any
) -> tuple[Any, list[DeviceEvent], list[tuple[int, int]], dict[str, int]]:
    """One profiler session: a settling step, then ``args.steps`` steps, each in its window."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with torch_profile(activities=activities) as prof:
        with record_function(SETTLE_LABEL):
            step()
            clock.sync()
        for i in range(args.steps):
            with record_function(f"{STEP_LABEL}{i}"):
                step()
                clock.sync()
    return (prof, *timeline(prof))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Set up, time, profile; the result as written to profile.json."""
    from benchkit.calls import denoiser_name, describe_call
    from benchkit.environment import collect_env
    from benchkit.measure import Clock

    device = torch.device(args.device)
    clock = Clock(device)
    env = collect_env(device)
    say(f"device {env['device_name']} | torch {env['torch']} | diffusers {env['diffusers']}")
    pipe, calls, costs = setup(args, device)
    transformer, accel = pipe.transformer, pipe.accel
    name = denoiser_name(accel)

    def step() -> None:
        for a, k in calls:
            transformer(*a, **k)

    notes: list[str] = []
    graphs = contextlib.nullcontext() if args.graphs else graphs_off(accel)
    with torch.no_grad(), graphs:
        step_ms, host_ms, min_ms = clock.time_steps(step, args.steps, args.warmup_calls)
        say(f"step {step_ms:.2f} ms (median of {args.steps}, unprofiled); profiling {args.steps} steps")
        before = accel.stats()[name]
        prof, events, windows, counts = profile(args, step, clock)
        after = accel.stats()[name]
    runner = {k: getattr(after, k) - getattr(before, k) for k in ("replays", "misses", "eager_calls")}
    made = (args.steps + 1) * len(calls)  # the settling step included
    if args.graphs and clock.cuda and runner["replays"] < made:
        notes.append(
            f"{made - runner['replays']} of the {made} profiled denoiser calls were not graph replays "
            f"(misses {runner['misses']}, eager calls {runner['eager_calls']}): part of the profile ran eagerly"
        )
    summary = summarize(events, windows)
    if not summary["events"]:
        if clock.cuda:
            notes.append(
                "the profiler recorded no CUDA kernel in the profiled steps: CUPTI saw none"
                + (
                    " of the graph replays; try --no-graphs, which launches the same kernels one by one"
                    if args.graphs
                    else ""
                )
            )
        else:
            notes.append(
                f"no CUDA kernels were recorded: on {env['device_name']} the profiler records CPU ops only "
                f"({counts['cpu_ops']} of them); kinds and idle time need a CUDA device"
            )
    if summary["unassigned"]:
        notes.append(f"{summary['unassigned']} device event(s) lay outside every step window and are left out")
    if args.trace:
        prof.export_chrome_trace(str(Path(args.out) / "trace.json"))
    config = {
        "model": args.model,
        "resolution": res_name(args.resolution),
        "size": args.size,
        "dtype": args.dtype,
        "device": args.device,
        "compile": args.compile,
        "graphs": args.graphs,
        "steps": args.steps,
        "warmup_calls": args.warmup_calls,
        "calls_per_step": len(calls),
        "calls": [describe_call(a, k) for a, k in calls],
        "profiled": "the denoiser calls of step 0 of a pipeline call, made directly through pipe.transformer "
        "(graph hook, runner replay); each step synchronised inside its window",
    }
    timing = {"step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3), "step_min_ms": round(min_ms, 3)}
    return {
        "env": env,
        "config": config,
        "setup": costs,
        "timing": timing,
        "runner": runner,
        "counts": counts,
        "profile": summary,
        "notes": notes,
    }


# -- profile.md -------------------------------------------------------------------------------
def _cell(text: str, limit: int = 160) -> str:
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def markdown(result: dict[str, Any], top: int) -> str:
    env, cfg, setup_, timing, prof = (result[k] for k in ("env", "config", "setup", "timing", "profile"))
    compiled = "compiled" if setup_["compiled_blocks"] else "not compiled"
    if not cfg["graphs"]:
        graphs = "graphs off (kernel by kernel)"
    elif setup_["captures"]:
        graphs = "CUDA graphs"
    else:
        graphs = f"no graphs ({setup_['warmup_skipped'] or 'nothing captured'})"
    cuda = env["device"] == "cuda"
    L = [f"# Per-kernel profile: {cfg['model']} {cfg['resolution']}, {compiled}, {graphs}", ""]
    L.append(
        f"**Device:** {env['device_name']} ({env['device']}"
        + (f", driver {env['driver']}, CUDA {env['cuda']}" if cuda else "")
        + ")  "
    )
    L.append(
        f"**Versions:** torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
        f"python {env['python']}; bcg-diffusers {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}  "
    )
    L.append(
        f"**Run:** {env['date']}; {setup_['describe']}; size {cfg['size']}, {cfg['dtype']}; "
        f"{cfg['steps']} profiled steps after {cfg['warmup_calls']} warm-up and {cfg['steps']} timed ones; "
        f"a step = {cfg['calls_per_step']} denoiser call(s) ({'; '.join(cfg['calls'])})  "
    )
    L.append(
        f"**Setup:** warm-up {setup_['warmup_s']} s (compile {setup_['compile_s']} s, "
        f"{setup_['compiled_blocks']} compiled blocks), {setup_['captures']} graph(s), {setup_['graph_mb']} MiB of graphs"
    )
    L.append("")
    clock = "CUDA events" if cuda else "wall clock"
    per_step = (
        f"**ms per denoiser step:** {timing['step_ms']:.2f} unprofiled (median, {clock}); {prof['step_ms']:.2f} "
        "profiled (mean window: first launch to the end of the step's synchronisation)"
    )
    if prof["events"]:
        per_step += (
            f", of which device busy {prof['busy_ms']:.2f}, idle {prof['idle_ms']:.2f} ({prof['idle_share']:.1%}; "
            f"{prof['gaps_ms']:.2f} between the first and the last kernel)"
        )
    L += [per_step + ".", ""]
    for note in result["notes"]:
        L.append(f"> {note}")
        L.append("")
    L += ["| kind | group | kernels/step | ms/step | share of step | what |", "|---|---|--:|--:|--:|---|"]
    for k in KINDS:
        row = prof["kinds"][k]
        L.append(
            f"| {k} | {row['group']} | {row['count_per_step']:g} | {row['ms_per_step']:.3f} | "
            f"{row['share']:.1%} | {DESCRIPTIONS[k]} |"
        )
    idle = (f"{prof['idle_ms']:.3f}", f"{prof['idle_share']:.1%}") if prof["events"] else ("-", "-")
    L.append(f"| idle | | | {idle[0]} | {idle[1]} | step window minus the union of busy intervals |")
    if prof["overlap_ms"] > 0:
        L.append("")
        L.append(f"Kernels overlapped on several streams for {prof['overlap_ms']:.3f} ms per step (counted in each).")
    L += ["", f"## Top {top} kernels", ""]
    kernels = list(prof["kernels"].items())[:top]
    if not kernels:
        L.append("No CUDA kernel recorded.")
    else:
        L += ["| # | kind | calls/step | ms/step | share | kernel |", "|--:|---|--:|--:|--:|---|"]
        for i, (kname, k) in enumerate(kernels, 1):
            L.append(
                f"| {i} | {k['kind']} | {k['count'] / prof['steps']:g} | {k['ms_per_step']:.3f} | "
                f"{k['share']:.1%} | {_cell(kname)} |"
            )
    L += [
        "",
        "Method: see the docstring of scripts/profile_step.py. Shares are of the profiled step's wall time; "
        "kinds from scripts/benchkit/kernels.py (a fused Triton kernel takes the kind of its dominant op).",
        "",
    ]
    return "\n".join(L)


def write(result: dict[str, Any], out: Path, top: int) -> None:
    """profile.json and profile.md under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "profile.md").write_text(markdown(result, top))


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = resolve(p, p.parse_args(argv))
    from benchkit.run import quiet_libraries

    quiet_libraries(args.verbose)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    write(result, out, args.top)
    for note in result["notes"]:
        say(f"note: {note}")
    say(f"wrote {out / 'profile.json'} and {out / 'profile.md'}" + (f" and {out / 'trace.json'}" if args.trace else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
