#!/usr/bin/env python
"""Breadth table: the zoo's diffusers pipelines at their released denoiser configs, eager vs graphs
vs compiled graphs, each in its own process.

    python scripts/bench_breadth.py --out out/breadth                          # GPU: eager and graphs
    python scripts/bench_breadth.py --only flux,sdxl --variants eager,graphs,compiled --out out/bc
    python scripts/bench_breadth.py --size tiny --only flux,wan --out /tmp/breadth  # CPU, seconds

Every family of :mod:`pipelines.zoo` (``--only`` picks some) is built with random weights and no
text encoders (random prompt embeddings of the shapes its encoders produce, seeded), at
``--size full`` (the released denoiser and VAE, bf16; the default on CUDA) or ``tiny`` (the CPU
default), and run at its usual geometry with ``output_type="latent"``. Each family runs in a
child process with ``--timeout`` seconds, so a failure, a hang or an out-of-memory ends only that
family; results are written after every family (and by the child after every variant, so a
timeout keeps the variants finished before it). In one process, side by side:

* ``eager``: the stock pipeline, one untimed call, then timed calls at each of ``--steps``
  (default 2 and 4). Per step is the slope of time over steps, the fixed cost its intercept (text
  handling, latents, scheduler set-up); end to end at the family's usual step count is derived
  from them: fixed + usual x per step (no call at the usual count is made).
* ``graphs``: ``accelerate_pipeline(pipe)`` with default options, ``pipe.accel.warmup`` at the
  geometry (its guidance branches, frames and the call's own embeddings; on a CPU no warm-up:
  graphs never capture there), one untimed call, the same timed calls. The latents are compared
  with eager's bit for bit (``torch.equal``) at every step count; the denoisers' counters
  (``pipe.accel.stats()``), the breaks found and, where no graph was kept, the report's reason are
  recorded, and whether the warm-up covered the calls (no miss, no eager call after it).
* ``compiled`` (CUDA only): ``accelerate_pipeline(pipe, compile=True)`` and a warm-up, the same
  timed calls; the graphs are compared bit for bit with the same compiled model with its runners
  off (a reference call), and the distance of compiled to stock eager is recorded. Skipped where
  the denoiser declares no ``_repeated_blocks``.

Times are host wall clock around a synchronised call. Outputs under ``--out``: ``breadth.json``
(device and versions, every number, the reports) and ``breadth.md`` (the table), plus
``logs/FAMILY.log`` (each child's log) and ``parts/FAMILY.json`` (each child's result).

All 16 families, eager and graphs, full size on one H200: about 6 minutes (an estimate from
earlier per-family timings; the video models take 40 to 70 s each). The compiled variant adds
each model's inductor compile (40 s to over 2 minutes): run it for a few families with a longer
``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):  # runnable from a plain checkout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchkit import settings  # noqa: E402
from benchkit.breadth_table import table  # noqa: E402
from benchkit.rows import err_text, rnd  # noqa: E402
from benchkit.settings import say  # noqa: E402

VARIANTS = ("eager", "graphs", "compiled")
# The parent's clock start, handed to its children so their progress lines share its time axis
# (perf_counter is one monotonic clock for every process of the machine).
CLOCK_ENV = "BCG_BREADTH_T_START"
SEED = 0
FULL_TIMEOUT_S = 150
TINY_TIMEOUT_S = 120


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _steps(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in _csv(text)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps takes integers like 2,4, got {text!r}") from None
    if len(values) < 2 or values[0] < 2:
        raise argparse.ArgumentTypeError(f"--steps needs two or more different counts of at least 2, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for breadth.json, breadth.md and logs/")
    p.add_argument("--only", type=_csv, default=None, help="comma-separated families (default: all)")
    p.add_argument("--size", choices=("tiny", "full"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument(
        "--variants", type=_csv, default=None, help="comma-separated of eager,graphs,compiled (default: eager,graphs)"
    )
    p.add_argument("--steps", type=_steps, default=[2, 4], help="the measured step counts (default 2,4)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per step count; the median is kept (default 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per family, its build included (default {FULL_TIMEOUT_S} full, {TINY_TIMEOUT_S} tiny)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the weights, the embeddings and the noise")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in each child (default: torch's)")
    p.add_argument(
        "--decode",
        action="store_true",
        help='decode every call with the VAE (output_type="pt"): end to end includes the decode, and the decoded images are compared',
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one family
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: the child's result file
    return p


def resolve(args: argparse.Namespace, names: tuple[str, ...]) -> argparse.Namespace:
    """Defaults that depend on the device; ValueError naming a bad value."""
    if args.only is not None:
        unknown = [n for n in args.only if n not in names]
        if unknown or not args.only:
            raise ValueError(
                f"--only: unknown families {', '.join(unknown) or '(none given)'}; known: {', '.join(names)}"
            )
    variants = args.variants if args.variants is not None else ["eager", "graphs"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    # Fixed order, eager first: every ratio is against eager of the same process.
    args.variants = [v for v in VARIANTS if v in variants or v == "eager"]
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here")
    cuda = args.device == "cuda"
    args.size = args.size or ("full" if cuda else "tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.timeout is None:
        args.timeout = float(FULL_TIMEOUT_S if args.size == "full" else TINY_TIMEOUT_S)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    return args


# --------------------------------------------------------------------------------------------
# The child: one family, every variant
# --------------------------------------------------------------------------------------------
def _fit(times: dict[int, float]) -> tuple[float, float]:
    """(seconds per step, fixed seconds): least squares over (steps, seconds)."""
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


class Runner:
    """Calls of one pipeline at one family's geometry, timed, their latents kept per step count."""

    def __init__(self, pipe: Any, fam: Any, args: argparse.Namespace, inputs: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.pipe, self.fam, self.args, self.inputs = pipe, fam, args, inputs
        self.device = torch.device(args.device)
        self.geometry = fam.geometry[args.size].as_kwargs()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def call(self, steps: int) -> Any:
        gen = self.torch.Generator(self.device).manual_seed(self.args.seed)
        out = self.pipe(
            **self.inputs,
            **self.geometry,
            num_inference_steps=steps,
            output_type="pt" if self.args.decode else "latent",
            return_dict=False,
            generator=gen,
        )
        return out[0]

    def timed(self, label: str) -> dict[str, Any]:
        """One untimed call, then ``--repeats`` timed calls per step count."""
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.call(self.args.steps[0])
        seconds: dict[int, list[float]] = {}
        latents: dict[int, Any] = {}
        for steps in self.args.steps:
            for _ in range(self.args.repeats):
                self.sync()
                t0 = time.perf_counter()
                out = self.call(steps)
                self.sync()
                seconds.setdefault(steps, []).append(time.perf_counter() - t0)
            latents[steps] = out.detach().clone()
        medians = {s: statistics.median(v) for s, v in seconds.items()}
        per_step, fixed = _fit(medians)
        usual = self.fam.steps
        row = {
            "status": "ok",
            "times_s": {str(s): [rnd(t, 6) for t in v] for s, v in seconds.items()},
            "per_step_ms": rnd(per_step * 1e3, 2),
            "fixed_ms": rnd(fixed * 1e3, 2),
            "e2e_s": rnd(fixed + usual * per_step, 3),
            "e2e_derived_from_steps": list(self.args.steps),
            "latents": {"shape": list(latents[steps].shape), "dtype": str(latents[steps].dtype).removeprefix("torch.")},
        }
        if self.device.type == "cuda":
            row["peak_gib"] = rnd(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        say(
            f"{self.fam.name} {label}: "
            + ", ".join(f"{s} steps {medians[s]:.3f} s" for s in medians)
            + f" -> {per_step * 1e3:.1f} ms/step, fixed {fixed * 1e3:.0f} ms, {usual} steps ~{fixed + usual * per_step:.2f} s"
        )
        self.latents = latents
        return row


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
    from accel.hooks.recipe import WARMUP_ARGUMENTS

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


def _accelerated(runner: Runner, eager: dict[int, Any], label: str, **options: Any) -> dict[str, Any]:
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


def _compiled(runner: Runner, eager: dict[int, Any]) -> dict[str, Any]:
    import torch
    from benchkit.calls import uncompile

    pipe, fam = runner.pipe, runner.fam
    denoiser = getattr(pipe, fam.denoiser)
    if runner.device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA (accelerate_pipeline compiles only on a CUDA device)"}
    if not getattr(denoiser, "_repeated_blocks", None):
        return {"status": "skipped", "reason": f"{type(denoiser).__name__} declares no _repeated_blocks to compile"}
    torch._dynamo.reset()
    try:
        row = _accelerated(runner, eager, "compiled", compile=True)
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


def _describe_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = type(v).__name__
    return out


def run_family(name: str, args: argparse.Namespace, result_path: Path) -> int:
    """Measure family ``name`` in this process; the result file is rewritten after every variant."""
    import torch
    from benchkit.environment import collect_env
    from benchkit.run import quiet_libraries

    from pipelines import zoo

    quiet_libraries(verbose=True)  # the child's log is a file of its own; progress goes to stdout
    if args.threads:
        torch.set_num_threads(args.threads)
    _register_project_recipes()
    fam, device = zoo.family(name), torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    geo = fam.geometry[args.size]
    row: dict[str, Any] = {
        "name": name,
        "pipeline": fam.pipeline,
        "released": fam.released,
        "size": args.size,
        "device": args.device,
        "dtype": args.dtype,
        "geometry": {"width": geo.width, "height": geo.height, "frames": geo.frames},
        "usual_steps": fam.steps,
        "measured_steps": list(args.steps),
        "cfg": fam.cfg,
        "guidance": dict(fam.guidance),
        "classes": {fam.denoiser: fam.denoiser_class, "vae": fam.vae_class, "scheduler": fam.scheduler_class},
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": "running",
        "variants": {},
        "env": collect_env(device),
    }

    def save() -> None:
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1, default=str))
        tmp.replace(result_path)

    t0 = time.perf_counter()
    try:
        pipe = zoo.build(name, args.size, device=device, dtype=dtype, seed=args.seed)
        row["build_s"] = rnd(time.perf_counter() - t0, 2)
        row["params"] = {k: sum(p.numel() for p in getattr(pipe, k).parameters()) for k in (fam.denoiser, "vae")}
        row["absent"] = zoo.absent_components(fam)
        inputs = zoo.call_inputs(name, args.size, device=device, dtype=dtype, seed=args.seed)
        row["inputs"] = _describe_inputs(inputs)
        n = row["params"][fam.denoiser]
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        say(f"{name}: built {fam.pipeline} ({size} denoiser parameters) in {row['build_s']} s")
        save()
        runner = Runner(pipe, fam, args, inputs)
        row["variants"]["eager"] = runner.timed("eager")
        eager = runner.latents
        save()
        if "graphs" in args.variants:
            row["variants"]["graphs"] = _variant(lambda: _accelerated(runner, eager, "graphs"), pipe)
            save()
        if "compiled" in args.variants:
            row["variants"]["compiled"] = _variant(lambda: _compiled(runner, eager), pipe)
            save()
        row["status"] = "ok"
    except Exception as exc:
        traceback.print_exc()
        row.update(status="error", reason=err_text(exc))
    row["wall_s"] = rnd(time.perf_counter() - t0, 1)
    save()
    return 0 if row["status"] == "ok" else 1


def _variant(fn: Any, pipe: Any) -> dict[str, Any]:
    """One accelerated variant; an exception is its row's error (the next variant still runs), and
    the pipeline is restored either way, its graph memory given back first."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {"status": "error", "reason": err_text(exc)}
    finally:
        if "accel" in pipe.__dict__:
            pipe.accel.release()
            pipe.accel.restore()


def _register_project_recipes() -> None:
    """The recipes pyproject.toml declares, registered by hand: a plain checkout (PYTHONPATH, no
    ``pip install -e .``) has no entry points, or those of another checkout."""
    from benchkit.calls import register_recipes

    try:
        import importlib

        import tomllib

        from accel import register_recipe

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        for target in project["project"]["entry-points"]["bcg_diffusers.recipes"].values():
            module, _, attr = target.partition(":")
            register_recipe(getattr(importlib.import_module(module), attr))
    except Exception as exc:  # Python 3.10 has no tomllib: the bench's own list
        say(f"warning: could not register pyproject.toml's recipes ({err_text(exc)}); registering the known ones")
        register_recipes()


# --------------------------------------------------------------------------------------------
# The parent: one child per family, the table after each
# --------------------------------------------------------------------------------------------
def _child_command(name: str, args: argparse.Namespace, result: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result), "--out", args.out]
    cmd += ["--size", args.size, "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    cmd += ["--variants", ",".join(args.variants), "--steps", ",".join(map(str, args.steps))]
    cmd += ["--repeats", str(args.repeats)]
    if args.decode:
        cmd.append("--decode")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def _tail(path: Path, lines: int = 3) -> str:
    with contextlib.suppress(OSError):
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(text[-lines:])[-600:]
    return ""


def run_child(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Family ``name`` in a child process, within ``--timeout``; its result (partial if it died)."""
    parts, logs = out / "parts", out / "logs"
    parts.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    result, log = parts / f"{name}.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as err:
        # A session of its own, so a timeout ends its helpers (inductor's compile workers) too.
        child = subprocess.Popen(_child_command(name, args, result), stderr=err, cwd=ROOT, start_new_session=True)
        try:
            rc: int | None = child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    row: dict[str, Any] = {"name": name, "variants": {}}
    with contextlib.suppress(OSError, ValueError):
        row = json.loads(result.read_text())
    row["wall_s"] = rnd(time.perf_counter() - t0, 1)
    if rc is None:
        done = row.get("variants") or {}
        running = "building" if "build_s" not in row else next((v for v in args.variants if v not in done), "?")
        row.update(status="timeout", reason=f"no result within --timeout {args.timeout:.0f} s (it was in: {running})")
    elif row.get("status") in (None, "running"):
        row.update(status="crashed", reason=f"the child exited with status {rc}: {_tail(log)}")
    return row


def save(results: dict[str, Any], out: Path, t0: float) -> None:
    """breadth.json (written whole, then renamed) and breadth.md."""
    results["elapsed_s"] = rnd(time.perf_counter() - t0, 1)
    tmp = out / "breadth.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "breadth.json")
    (out / "breadth.md").write_text(table(results))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        with contextlib.suppress(KeyError, ValueError):
            settings.T_START = float(os.environ[CLOCK_ENV])
        return run_family(args.worker, args, Path(args.result))
    os.environ[CLOCK_ENV] = repr(settings.T_START)
    from pipelines.zoo import NAMES

    try:
        args = resolve(args, NAMES)
    except ValueError as exc:
        print(f"bench_breadth.py: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(NAMES)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "config": {
            "argv": list(sys.argv[1:] if argv is None else argv),
            "families": names,
            "size": args.size,
            "device": args.device,
            "dtype": args.dtype,
            "decode": args.decode,
            "variants": args.variants,
            "steps": args.steps,
            "repeats": args.repeats,
            "timeout_s": args.timeout,
            "seed": args.seed,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "results": {},
    }
    say(f"breadth: {len(names)} families, size {args.size}, {args.device} {args.dtype}, {', '.join(args.variants)}")
    for i, name in enumerate(names, 1):
        say(f"[{i}/{len(names)}] {name}: starting (timeout {args.timeout:.0f} s)")
        row = run_child(name, args, out)
        results["results"][name] = row
        save(results, out, t0)
        g = (row.get("variants") or {}).get("graphs") or {}
        say(
            f"[{i}/{len(names)}] {name}: {row['status']} in {row['wall_s']} s"
            + (f"; graphs {g.get('graphs_used')}, equal {g.get('equal')}" if g.get("status") == "ok" else "")
            + (f"; {row.get('reason')}" if row["status"] != "ok" else "")
        )
    say(f"wrote {out / 'breadth.json'} and {out / 'breadth.md'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
