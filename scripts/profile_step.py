#!/usr/bin/env python
"""Per-kernel profile of one denoising step, compiled and replayed as CUDA graphs: GPU time by kind,
float8 included, the floor it implies, and the call outside the denoiser.

The pipeline is set up the way a user would: ``build_pipeline(model, size)``, then
``accelerate_pipeline(pipe, compile=..., quantize=...)`` and ``pipe.accel.warmup([resolution], ...)``
(Z-Image as Turbo: guidance 0; Qwen-Image with true CFG and a negative prompt; Qwen-Image 2.1
without guidance, its prefix K/V cache on). One real pipeline call then records, with a forward
pre-hook, the denoiser calls of its step 0 (one for Z-Image, two for Qwen-Image: the conditional
and the unconditional branch); for Qwen-Image 2.1, of its step 1, the kind of 39 of its 40 steps
(step 0 also fills the cache). A *step* below is those calls.

``--batch N`` (default 1): the shapes a server runs. The warm-up captures at batch size N
(``batch_sizes=[N]``, as the server warms a bucket) and every pipeline call below makes N images as
the server's calls do (:func:`benchkit.calls.batch_kwargs`: a prompt and a negative prompt per
image, each image its own generator): the recorded step, the products by shape (M is tokens x N),
hence the floor, and the call outside. Times stay per step (of N images); both files state the
batch and the step's ms per image (step ms / N).

What is profiled: the step's denoiser calls made directly, ``pipe.transformer(...)`` (through the
graph hook into the runner's replay: the graphs a pipeline call replays), so a step's window holds
the denoiser's work only and ends with a synchronisation. ``--warmup-calls`` untimed steps come
first, then ``--steps`` steps timed without the profiler (CUDA events: the step time), then one
profiler session (:mod:`benchkit.profiler`): a settling step, left out, then ``--steps`` profiled
steps. CUPTI's records include the kernels a graph replay launches, with their own names and
timestamps. Tearing CUPTI down and re-initialising it lazily has crashed with CUDA graphs: this
script sets ``TEARDOWN_CUPTI=0`` and ``DISABLE_CUPTI_LAZY_REINIT=1`` unless they are set, and
profiles once per variant.

``--quantize fp8``: the same pipeline with float8 layers (``quantize="fp8"``, its ``fp8_budget``
selection). Beside it (``--bf16-beside``, on by default with it) the bf16 compiled step is profiled
first on the same pipeline, which is then restored and accelerated again with float8 (float8 is
one-way, so bf16 goes first).

Before anything is accelerated, one step runs with a hook on every Linear layer
(:mod:`benchkit.gemm_shapes`): the step's products by (M, K, N), float8 or bf16 (the layers the
selection put in float8), each timed alone on the device; with the profile's kernel kinds
(:mod:`benchkit.kernels`: float8 and bf16 GEMMs, float8 quantization, attention, norms, ...) they
give the floor (:mod:`benchkit.floor`): products at the measured peak rates (float8 1160-1340
TFLOP/s, bf16 725-777 on one H200), every other kernel as measured. The same step's attention
calls are recorded by shape (:mod:`benchkit.attention_shapes`) and timed alone (cuDNN's SDPA,
FlashAttention-3 in bf16 and in float8), for the floor from the work (:mod:`benchkit.work_floor`):
products at those peaks or their weights' bytes, attention at FlashAttention-3's rate (float8 for
the attention layers in float8), nothing else; each kernel kind of the measured step against it.
``--attention fa3``: ``attention="fa3"`` (with ``--quantize fp8`` the attention is measured for
float8 too; the bf16 step beside it runs FlashAttention-3 in bf16). ``--outside``: one end-to-end
call split into phases (:mod:`benchkit.phases`: text encoder, denoiser, the rest of the loop with
the scheduler, the VAE decode, post-processing), once with the decoder's graphs and once with the
decoder eager.

``--no-graphs``: the same accelerated (and compiled) pipeline with its graphs released and the
runners off: the same kernels launched one by one (the profiler's host overhead makes its idle
time an upper bound).

Outputs under ``--out``: profile.json, profile.md (:mod:`benchkit.profile_report`), trace.json
with ``--trace``. Device, versions, date and commit are in both.

    python scripts/profile_step.py --model z-image --quantize fp8 --out out/profile-fp8/z-image   # GPU
    python scripts/profile_step.py --model qwen-image --no-graphs --out out/profile/qwen-nographs
    python scripts/profile_step.py --model z-image --resolution 512x512 --batch 8 --quantize fp8 \\
        --out out/profile-fp8/z-image-512-b8                                         # GPU: a server's bucket
    python scripts/profile_step.py --model z-image --size tiny --no-compile --resolution 64x64 \\
        --steps 2 --out /tmp/profile                                                 # CPU: CPU ops only

On a CPU the profiler records CPU ops only: the files are written and say that no CUDA kernel was
recorded. Full sizes and float8 need a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Kineto reads these when a session starts and ends: CUPTI stays up for the whole process, as torch
# arranges for its own cudagraphs (a teardown and lazy re-init under CUDA graphs has crashed).
os.environ.setdefault("TEARDOWN_CUPTI", "0")
os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")

import torch
from benchkit.fp8_run import fp8_backend
from benchkit.profile_report import markdown
from benchkit.profiler import profile, timeline  # noqa: F401 (the tests read timeline here)
from benchkit.settings import NEGATIVE, PROMPT, SEED, parse_resolution, res_name, say, uses_cfg
from benchkit.step_floors import floors, record_step
from benchkit.timeline import summarize

MODELS = ("z-image", "qwen-image", "qwen-image-2.1", "flux")
# The step recorded: Qwen-Image 2.1's step 0 fills its prefix K/V cache (text tokens in every
# block), and each later step reads it (image tokens only), so step 1 is the step of 39 in 40.
RECORD_STEP = {"qwen-image-2.1": 1}
# pipe_kwargs' steps: only the recorded step runs, so the count changes no call's shapes.
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
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--compile", action=on_off, default=True, help="compile=True (CUDA only; default on)")
    p.add_argument("--graphs", action=on_off, default=True, help="replay the graphs (default); off: kernel by kernel")
    p.add_argument("--quantize", choices=("fp8",), default=None, help="quantize='fp8' (CUDA only)")
    p.add_argument("--fp8-backend", choices=("default", "torchao", "scaled-mm"), default="default")
    p.add_argument("--attention", choices=("fa3",), default=None, help="attention='fa3' (FlashAttention-3, Hopper)")
    p.add_argument("--bf16-beside", action=on_off, default=None, help="with --quantize: the bf16 step first (default)")
    p.add_argument("--gemms", action=on_off, default=True, help="the step's products by shape and the floor")
    p.add_argument("--outside", action=on_off, default=True, help="one end-to-end call split into phases")
    p.add_argument("--outside-steps", type=int, default=20, help="steps of that call (Z-Image: 9 always)")
    p.add_argument("--batch", type=int, default=1, help="images per pipeline call (the warm-up's batch size)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (each: the denoiser calls of one step)")
    p.add_argument("--warmup-calls", type=int, default=2, help="untimed steps before timing (default 2)")
    p.add_argument("--top", type=int, default=25, help="kernels listed in profile.md (default 25)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace (trace.json)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile-cache", metavar="DIR", default=None, help="compile_cache_dir of accelerate_pipeline")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's info messages")
    return p


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the device; bad values end in one line (exit status 2)."""
    for name, low in (("batch", 1), ("steps", 1), ("warmup_calls", 0), ("top", 1), ("outside_steps", 1)):
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
    if args.quantize and args.device != "cuda":
        p.error(f"--quantize {args.quantize} needs a CUDA device (float8 products)")
    args.bf16_beside = bool(args.quantize) if args.bf16_beside is None else args.bf16_beside and bool(args.quantize)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


# -- the pipeline, set up as a user would ---------------------------------------------------------
def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, float]:
    from benchkit.calls import register_recipes

    from pipelines.builders import build_pipeline, describe

    register_recipes()
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pipe = build_pipeline(args.model, size=args.size, device=device, dtype=dtype, seed=SEED)
    pipe.set_progress_bar_config(disable=True)
    say(f"built {describe(pipe)} in {time.perf_counter() - t0:.1f} s")
    return pipe, time.perf_counter() - t0


def _step(args: argparse.Namespace) -> int:
    return RECORD_STEP.get(args.model, 0)


def linear_calls(pipe: Any, args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """The recorded step's Linear and attention calls of the stock denoiser (before anything is compiled or quantized)."""
    from benchkit.calls import record_step_calls

    calls = record_step_calls(pipe, args.model, args.resolution, _RECORD_ARGS, device, args.batch, _step(args))
    return record_step(pipe.transformer, lambda: [pipe.transformer(*a, **k) for a, k in calls])


def setup(args: argparse.Namespace, pipe: Any, device: torch.device, quantize: str | None) -> tuple[list, dict]:
    """Accelerate and warm up; the recorded step's denoiser calls and the setup's costs."""
    from benchkit.calls import accelerate, compiled_blocks, record_step_calls

    from pipelines.builders import describe

    options = dict(compile=args.compile, compile_cache_dir=args.compile_cache, attention=args.attention)
    accelerate(pipe, **options, **({"quantize": quantize} if quantize else {}))
    cfg = uses_cfg(args.model)
    t0 = time.perf_counter()
    with torch.no_grad():
        report = pipe.accel.warmup(
            [args.resolution],
            batch_sizes=[args.batch],
            prompts=[PROMPT],
            negative_prompt=NEGATIVE if cfg else None,
            cfg=cfg,
            progress=False,
        )
    warmup_s = time.perf_counter() - t0
    say(f"warm-up in {warmup_s:.1f} s: {report.total_captures} graph(s), compile {report.total_compile_seconds:.1f} s")
    calls = record_step_calls(pipe, args.model, args.resolution, _RECORD_ARGS, device, args.batch, _step(args))
    quantization = pipe.accel.quantization
    costs = {
        "describe": describe(pipe),
        "warmup_s": round(warmup_s, 2),
        "compile_s": round(report.total_compile_seconds, 2),
        "captures": report.total_captures,
        "graph_mb": round(pipe.accel.graph_memory_bytes() / 2**20, 1),
        "compiled_blocks": len(compiled_blocks(pipe.transformer)),
        "warmup_skipped": report.skipped,
        "quantization": quantization.summary() if quantization is not None else None,
    }
    return calls, costs


@contextlib.contextmanager
def graphs_off(accel: Any) -> Iterator[None]:
    """The pipeline's calls run eagerly over the same (compiled) blocks: graphs released, runners off."""
    from accel.hooks import uncaptured

    accel.release()
    with uncaptured(accel.runners.values()):
        yield


def profile_variant(args: argparse.Namespace, pipe: Any, device: torch.device, quantize: str | None) -> dict:
    """Set up one variant (bf16, or float8), time and profile its step."""
    from benchkit.calls import denoiser_name, describe_call
    from benchkit.measure import Clock

    clock = Clock(device)
    calls, costs = setup(args, pipe, device, quantize)
    transformer, accel = pipe.transformer, pipe.accel
    name = denoiser_name(accel)

    def step() -> None:
        for a, k in calls:
            transformer(*a, **k)

    notes: list[str] = []
    with torch.no_grad(), contextlib.nullcontext() if args.graphs else graphs_off(accel):
        step_ms, host_ms, min_ms = clock.time_steps(step, args.steps, args.warmup_calls)
        each = f", {step_ms / args.batch:.2f} ms per image of {args.batch}" if args.batch > 1 else ""
        say(f"{quantize or 'bf16'} step {step_ms:.2f} ms (median of {args.steps}{each}); profiling {args.steps} steps")
        before = accel.stats()[name]
        prof, events, windows, counts = profile(args.steps, step, clock.sync, clock.cuda)
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
        notes.append(
            "the profiler recorded no CUDA kernel in the profiled steps: CUPTI saw none"
            + (" of the graph replays; try --no-graphs" if args.graphs else "")
            if clock.cuda
            else f"no CUDA kernels were recorded: on {device} the profiler records CPU ops only "
            f"({counts['cpu_ops']} of them); kinds and idle time need a CUDA device"
        )
    if summary["unassigned"]:
        notes.append(f"{summary['unassigned']} device event(s) lay outside every step window and are left out")
    if args.trace:
        prof.export_chrome_trace(str(Path(args.out) / f"trace{'-' + quantize if quantize else ''}.json"))
    timing = {"step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3), "step_min_ms": round(min_ms, 3)}
    timing["step_ms_per_image"] = round(step_ms / args.batch, 3)
    return {
        "calls": [describe_call(a, k) for a, k in calls],
        "setup": costs,
        "timing": timing,
        "runner": runner,
        "counts": counts,
        "profile": summary,
        "notes": notes,
    }


def outside(args: argparse.Namespace, pipe: Any, device: torch.device) -> dict[str, Any]:
    """One end-to-end call of ``--batch`` images in phases, with the decoder's graphs and with it eager."""
    import dataclasses

    from benchkit.calls import batch_kwargs
    from benchkit.phases import measure_breakdown
    from benchkit.settings import steps_of

    e2e = argparse.Namespace(steps_e2e=args.outside_steps)

    def call() -> Any:  # the step's batch: N prompts, a generator each
        return pipe(**batch_kwargs(args.model, args.resolution, e2e, device, args.batch))

    decoder = pipe.accel.runners.get("vae.decoder")
    with torch.no_grad():
        call()  # settles what a first call does (lazy buffers, the scheduler's tables)
        before = decoder.stats(memory=False).replays if decoder is not None else 0
        graphs = measure_breakdown(pipe, call, device)
        replays = decoder.stats(memory=False).replays - before if decoder is not None else 0
        if decoder is not None:
            decoder.enabled = False
        try:
            eager = measure_breakdown(pipe, call, device)
        finally:
            if decoder is not None:
                decoder.enabled = True
    say(f"outside the denoiser: {graphs.line()}")
    return {
        "steps": steps_of(args.model, e2e),
        "batch": args.batch,
        "graphs": dataclasses.asdict(graphs),
        "eager_decoder": dataclasses.asdict(eager),
        "decoder_replays": replays,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, profile each variant, the products and the floor, the call outside; profile.json's dict."""
    from benchkit.environment import collect_env

    device = torch.device(args.device)
    env = collect_env(device)
    say(f"device {env['device_name']} | torch {env['torch']} | diffusers {env['diffusers']}")
    pipe, build_s = build(args, device)
    shapes, attention_calls = linear_calls(pipe, args, device) if args.gemms else ({}, {})
    beside = None
    if args.bf16_beside:
        beside = profile_variant(args, pipe, device, None)
        pipe.accel.restore()
        torch._dynamo.reset()  # the float8 blocks compile anew: no recompile limit carried over
    with fp8_backend(args.fp8_backend):
        main = profile_variant(args, pipe, device, args.quantize)
    main["setup"]["build_s"] = round(build_s, 2)
    result: dict[str, Any] = {"env": env, "config": config(args, main)}
    result.update({k: main[k] for k in ("setup", "timing", "runner", "counts", "profile", "notes")})
    if beside is not None:
        result["beside"] = {"variant": "bf16", **beside}
    if shapes:
        result.update(floors(pipe, device, args.quantize or "bf16", main, beside, shapes, attention_calls))
    if args.outside:
        result["outside"] = outside(args, pipe, device)
    return result


def config(args: argparse.Namespace, main: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": args.model,
        "resolution": res_name(args.resolution),
        "batch": args.batch,
        "size": args.size,
        "dtype": args.dtype,
        "device": args.device,
        "compile": args.compile,
        "graphs": args.graphs,
        "quantize": args.quantize,
        "attention": args.attention,
        "fp8_backend": args.fp8_backend if args.quantize else None,
        "bf16_beside": args.bf16_beside,
        "steps": args.steps,
        "warmup_calls": args.warmup_calls,
        "calls_per_step": len(main["calls"]),
        "calls": main["calls"],
        "profiled": f"the denoiser calls of step {_step(args)} of a pipeline call, made directly through pipe.transformer "
        "(graph hook, runner replay); each step synchronised inside its window",
    }


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
    say(f"wrote {out / 'profile.json'} and {out / 'profile.md'}" + (" and trace files" if args.trace else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
