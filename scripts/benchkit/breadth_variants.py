"""The accelerated variants of scripts/bench_breadth.py on a family's pipeline: graphs and compiled
graphs, each warmed up, timed, its counters and its equality with eager; why no graph was kept."""

from __future__ import annotations

import math
import time
from typing import Any

from .breadth_calls import Runner
from .rows import err_text, rnd
from .settings import say


def _compare(a: dict[int, Any], b: dict[int, Any]) -> tuple[bool, float]:
    """(bit-equal at every step count, largest absolute difference)."""
    import torch

    equal, worst = True, 0.0
    for steps, x in a.items():
        y = b[steps]
        if x.shape != y.shape:
            return False, math.inf
        equal = equal and torch.equal(x, y)
        worst = max(worst, float((x.float() - y.float()).abs().max()))
    return equal, worst


def _report_body(report: str, name: str) -> list[str]:
    """The indented lines under component ``name`` in ``pipe.accel.report()``."""
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"  {name} ("):
            body = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("    "):
                    break
                body.append(follow.strip())
            return body
    return []


def _why_not(report: str, inactive: dict[str, str | None]) -> str:
    """Why a denoiser kept no graph ('' where each kept one): the hook's reason where graphs are
    off for it (``inactive``: denoiser -> reason or None), else the report's one line for it."""
    for name, reason in inactive.items():
        if reason:
            return f"{name}: {reason}"
        for prefix in ("capture failed:", "no graphs:"):
            for line in _report_body(report, name):
                if line.startswith(prefix):
                    return f"{name}: {line}"
    return ""


def _stats(pipe: Any, denoisers: list[str]) -> dict[str, dict[str, Any]]:
    return {n: s.as_dict() for n, s in pipe.accel.stats().items() if n in denoisers}


def _delta(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, int]:
    keys = ("captures", "replays", "misses", "eager_calls", "capture_failures")
    return {k: sum(after[n][k] - before.get(n, {}).get(k, 0) for n in after) for k in keys}


def _warm_up(pipe: Any, fam: Any, size: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """``pipe.accel.warmup`` at the family's geometry with the call's own embeddings."""
    geo = fam.geometry[size]
    # The warm-up sets guidance (and geometry) itself, the family's way: only the rest goes in.
    from accel.hooks.recipes import WARMUP_ARGUMENTS

    given = {k: v for k, v in inputs.items() if k not in WARMUP_ARGUMENTS}
    options: dict[str, Any] = {"cfg": fam.cfg, "call_kwargs": given, "progress": False}
    if geo.frames is not None:
        options["num_frames"] = geo.frames
    t0 = time.perf_counter()
    report = pipe.accel.warmup([(geo.width, geo.height)], **options)
    return {
        "wall_s": rnd(time.perf_counter() - t0, 2),
        "capture_s": rnd(report.total_seconds, 2),
        "compile_s": rnd(report.total_compile_seconds, 2),
        "captures": report.total_captures,
        "skipped": report.skipped,
        "text": str(report),
    }


def accelerated_variant(runner: Runner, eager: dict[int, Any], label: str, **options: Any) -> dict[str, Any]:
    """accelerate_pipeline(**options), warm-up (CUDA), the timed calls, counters and equality."""
    from accel import accelerate_pipeline

    pipe, fam, args = runner.pipe, runner.fam, runner.args
    accelerate_pipeline(pipe, **options)
    denoisers = list(pipe.accel.recipes)
    row: dict[str, Any] = {"options": {k: str(v) for k, v in options.items()}, "denoisers": denoisers}
    row["recipes"] = {n: r.name for n, r in pipe.accel.recipes.items()}
    if runner.device.type == "cuda":
        try:
            row["warmup"] = _warm_up(pipe, fam, args.size, runner.inputs)
            say(f"{fam.name} {label}: warm-up {row['warmup']['wall_s']} s, {row['warmup']['captures']} captures")
        except Exception as exc:  # the calls below then run as the options allow (eagerly)
            row["warmup"] = {"error": err_text(exc)}
            say(f"{fam.name} {label}: warm-up failed: {err_text(exc)}")
    else:
        row["warmup"] = {"skipped": "no CUDA: graphs never capture here, so there is nothing to warm up"}
    before = _stats(pipe, denoisers)
    row.update(runner.timed(label))
    after = _stats(pipe, denoisers)
    report = pipe.accel.report()
    calls = _delta(after, before)
    equal, worst = _compare(runner.latents, eager)
    replayed = calls["replays"] > 0
    hit_all = replayed and calls["misses"] == 0 and calls["eager_calls"] == 0
    row.update(
        equal=equal,
        max_abs_diff=rnd(worst, 6),
        stats_after_warmup=before,
        stats=after,
        timed_calls=calls,
        warmup_covered=hit_all if "captures" in row["warmup"] else None,
        graphs_used="yes" if hit_all else ("partly" if replayed else "no"),
        why_not="" if hit_all else _why_not(report, {n: pipe.accel.hooks[n].inactive_reason for n in denoisers}),
        found_breaks={n: [str(s) for s in sites] for n, sites in pipe.accel.found_breaks.items()},
        graph_memory_mib=rnd(pipe.accel.graph_memory_bytes() / 2**20, 1),
        report=report,
    )
    return row


def compiled_variant(runner: Runner, eager: dict[int, Any]) -> dict[str, Any]:
    import torch

    from .calls import uncompile

    pipe, fam = runner.pipe, runner.fam
    denoiser = getattr(pipe, fam.denoiser)
    if runner.device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA (accelerate_pipeline compiles only on a CUDA device)"}
    if not getattr(denoiser, "_repeated_blocks", None):
        return {"status": "skipped", "reason": f"{type(denoiser).__name__} declares no _repeated_blocks to compile"}
    torch._dynamo.reset()
    try:
        row = accelerated_variant(runner, eager, "compiled", compile=True)
        compiled = runner.latents
        runners = [pipe.accel.runners[n] for n in row["denoisers"]]
        for r in runners:
            r.enabled = False
        try:
            reference = {s: runner.call(s).detach().clone() for s in compiled}
        finally:
            for r in runners:
                r.enabled = True
        same, worst = _compare(compiled, reference)
        row.update(equal_to_compiled_eager=same, max_abs_diff_to_compiled_eager=rnd(worst, 6))
        row["max_abs_diff_to_stock_eager"] = row.pop("max_abs_diff")
        row["equal_to_stock_eager"] = row.pop("equal")
        return row
    finally:
        if "accel" in pipe.__dict__:
            pipe.accel.restore()
        uncompile(denoiser)
        torch._dynamo.reset()
