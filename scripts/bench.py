#!/usr/bin/env python
"""Side-by-side benchmark: eager vs bcg-diffusers vs one whole-forward CUDA graph vs torch.compile.

For each model (Qwen-Image, Z-Image) the pipeline is built once; for each resolution every variant
runs in this one process on the *same* denoiser call: the exact ``pipe.transformer(...)`` call of
step 0 of a real pipeline run at that resolution (recorded with a forward pre-hook; Z-Image passes
positional lists, Qwen-Image keyword arguments; with Qwen-Image's true CFG a step makes two calls of
different text lengths and the first, the conditional one, is benchmarked).

Variants (``--variants``):

* ``eager``      the stock forward, no accelerator attached.
* ``bcg``        ``accelerate_pipeline(pipe)`` + ``pipe.accel.warmup`` (timed cold: the capture
                 cost), then the call goes through the diffusers hook into the runner's replay.
                 On a CPU it still runs: the runner then runs the stock forward eagerly.
* ``graph``      one ``torch.cuda.CUDAGraph`` over the whole stock forward (2 warm-up runs on a
                 side stream, capture, replay). A forward that cannot be captured whole records
                 status "error" with the reason. Needs CUDA.
* ``compile``    ``torch.compile(transformer, dynamic=False)``; the first call is the compile time.
* ``compile-ro`` the same with ``mode="reduce-overhead"`` (CUDA graphs inside). Needs CUDA.
  Compile variants take a minute or two per resolution on full-size models, so they are opt-in
  on GPU. On CPU in ``--smoke`` mode they are skipped (inductor on a CPU needs a C++ toolchain and
  tens of seconds per shape even for the tiny models, which would dwarf the smoke run).

Measured per (model, resolution, variant): median step time over ``--repeats`` after warm-up
(CUDA events on GPU, wall clock on CPU), median host time (wall time until the call returns: the
launch overhead), back-to-back time per call, GPU-busy fraction (eager and bcg: kernel time from
the profiler's CUDA activity, union of intervals, over the wall time of a back-to-back sequence),
capture/compile time, peak memory (``torch.cuda.max_memory_allocated``, reset per variant), graph
memory, the largest difference of the output from eager's, and end to end (eager vs bcg) at
``--e2e-resolutions``: the full pipeline call with the model's realistic setting (Z-Image: 9 steps,
guidance 0 as Turbo; Qwen-Image: true CFG with a negative prompt, ``--steps-e2e`` steps), median
of ``--e2e-runs`` runs after one warm-up run, same seed, final latents compared (bit-equal expected
for Z-Image; max abs difference for Qwen-Image, whose text is padded to a bucket under bcg).
After the cases of a model, a "memory vs number of captured resolutions" series warms up the
``--series-count`` largest resolutions one after the other on one accelerated pipeline.

compile_s is the first call; inductor keeps on-disk caches, so a machine that compiled the same
shapes before reports less (``--no-compile-cache`` for cold numbers everywhere).

Default GPU set (full-size random-weight models, bf16, both models, 256 512 768 1024 768x512,
eager bcg graph, end to end at 512 and 1024): about 6 minutes on one H200 (Z-Image ~1.5 min,
Qwen-Image ~4 min, most of it Qwen-Image's eager end-to-end runs: 20 steps x 2 calls at ~0.2 s).
Each compile variant adds its compile time per resolution and model (on the H200: 37-65 s for
Z-Image, 124-145 s for Qwen-Image).

Outputs under ``--out``: results.json, results.md, step_time.png, graph_memory.png (rewritten
after every case, so a run stopped early still leaves its numbers). Runs too long for one sitting
(compile variants on both models take over half an hour) can be split by model and resolution and
joined with ``--merge DIR ...``, which measures nothing and writes one report.

    python scripts/bench.py --out out/bench                       # GPU default set
    python scripts/bench.py --smoke --out /tmp/bench              # tiny models on CPU, seconds
    python scripts/bench.py --models z-image --resolutions 512 1024 --variants eager bcg compile-ro --out out/zc
    python scripts/bench.py --merge out/zc out/qc --out out/compile   # one report from separate runs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a plain checkout, without `pip install -e .`
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

VARIANTS = ("eager", "bcg", "bcg-exact", "graph", "compile", "compile-ro")
STATUSES = ("ok", "skipped", "error")
PROMPT = "a red fox standing in fresh snow at dawn, soft golden light, highly detailed photograph"
NEGATIVE = "blurry, low quality, watermark"
SEED = 0
ZIMAGE_STEPS = 9
QWEN_TRUE_CFG = 4.0
MiB = 2**20
PLOTS = ("step_time.png", "graph_memory.png")

logger = logging.getLogger("bench")
T_START = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def parse_resolution(text: str) -> tuple[int, int]:
    """"512" -> (512, 512); "768x512" -> (768, 512) (width x height)."""
    try:
        if "x" in text.lower():
            w, h = (int(v) for v in text.lower().split("x"))
        else:
            w = h = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a resolution is N or WxH, got {text!r}") from None
    if w <= 0 or h <= 0 or w % 16 or h % 16:
        raise argparse.ArgumentTypeError(f"{text}: width and height must be positive multiples of 16")
    return w, h


def res_name(wh: tuple[int, int]) -> str:
    return f"{wh[0]}x{wh[1]}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark eager vs bcg vs one whole-forward CUDA graph vs torch.compile.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", nargs="+", default=["z-image", "qwen-image"], help="z-image, qwen-image")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--resolutions", nargs="+", type=parse_resolution, default=None,
                   help="N or WxH (width x height); default 256 512 768 1024 768x512 (full), 64 96x64 (tiny)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                   help="default on CUDA: eager bcg graph (compile variants are opt-in); smoke: all")
    p.add_argument("--steps-e2e", type=int, default=None, help="Qwen-Image steps end to end (default 20; smoke 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed step calls per variant (default 10; smoke 3)")
    p.add_argument("--warmup-calls", type=int, default=None, help="untimed calls before timing (default 3; smoke 1)")
    p.add_argument("--seq-calls", type=int, default=None, help="back-to-back calls for GPU-busy (default 5; smoke 2)")
    p.add_argument("--e2e-runs", type=int, default=None, help="timed end-to-end runs after one warm-up (default 3; smoke 1)")
    p.add_argument("--e2e-resolutions", nargs="+", type=parse_resolution, default=None,
                   help="end-to-end at these of --resolutions (default 512 1024; tiny: the first)")
    p.add_argument("--series-count", type=int, default=3,
                   help="memory series: warm up this many of the largest resolutions cumulatively (0: off)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="measure nothing: merge the results.json of earlier runs (e.g. one per device call) into "
                        "one report under --out. Each model and resolution must come from a single run, so every "
                        "ratio stays one measured inside one process")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end pipeline runs")
    p.add_argument("--no-busy", action="store_true", help="skip the profiled GPU-busy measurement")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models on CPU, 64 and 96x64, few repeats: runs in seconds (CI)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="disable inductor's on-disk caches (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): every compile_s "
                        "is cold, also on a machine that compiled these shapes before")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; smoke: 1, the tiny models gain nothing from more)")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's info messages")
    return p


def resolve_config(args: argparse.Namespace) -> argparse.Namespace:
    smoke = args.smoke
    if args.device is None:
        args.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    cuda = args.device == "cuda"
    if args.size is None:
        args.size = "tiny" if smoke or not cuda else "full"
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.resolutions is None:
        args.resolutions = (
            [(64, 64), (96, 64)] if args.size == "tiny"
            else [(256, 256), (512, 512), (768, 768), (1024, 1024), (768, 512)]
        )
    args.resolutions = list(dict.fromkeys(args.resolutions))
    if args.variants is None:
        args.variants = list(VARIANTS) if smoke else (["eager", "bcg", "graph"] if cuda else ["eager", "bcg"])
    args.variants = [v for v in VARIANTS if v in args.variants]  # fixed order: eager first
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")  # every ratio is against eager, measured in the same run
    few = smoke or args.size == "tiny"
    if args.threads is None and smoke:
        args.threads = 1
    args.steps_e2e = args.steps_e2e or (2 if smoke else 20)
    args.repeats = args.repeats or (3 if few else 10)
    args.warmup_calls = args.warmup_calls if args.warmup_calls is not None else (1 if few else 3)
    args.seq_calls = args.seq_calls or (2 if few else 5)
    args.e2e_runs = args.e2e_runs or (1 if smoke else 3)
    if args.e2e_resolutions is None:
        args.e2e_resolutions = [args.resolutions[0]] if few else [(512, 512), (1024, 1024)]
    args.e2e_resolutions = [r for r in args.e2e_resolutions if r in args.resolutions]
    if args.no_e2e:
        args.e2e_resolutions = []
    return args


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------
def _version(name: str) -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version(name)
    except Exception:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def _cpu_name() -> str:
    with contextlib.suppress(Exception):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def collect_env(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": "cpu",
        "device_name": _cpu_name(),
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": bool(_run(["git", "status", "--porcelain"])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device="cuda", device_name=torch.cuda.get_device_name(device),
                   device_memory_gib=round(props.total_memory / 2**30, 1))
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0].strip() if smi else f"unknown (nvidia-smi absent; CUDA runtime {torch.version.cuda})"
    return env


# ------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------
def clone_tree(obj: Any) -> Any:
    """Deep copy of a call's arguments: tensors cloned, containers rebuilt, the rest shared."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(clone_tree(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(o) for o in obj)
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_of(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_of(o)]
    if hasattr(obj, "to_tuple"):  # diffusers BaseOutput
        return tensors_of(obj.to_tuple())
    return []


def max_abs_diff(a: Any, b: Any) -> float | None:
    ta, tb = tensors_of(a), tensors_of(b)
    if not ta or len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return None
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(ta, tb))


def describe_call(args: tuple, kwargs: dict) -> str:
    def d(o: Any) -> str:
        if isinstance(o, torch.Tensor):
            return "x".join(map(str, o.shape)) or "scalar"
        if isinstance(o, (list, tuple)) and o and all(isinstance(t, torch.Tensor) for t in o):
            return "[" + ", ".join(d(t) for t in o) + "]"
        return type(o).__name__ if o is not None else "None"

    parts = [d(a) for a in args] + [f"{k}={d(v)}" for k, v in kwargs.items() if isinstance(v, (torch.Tensor, list, tuple))]
    return ", ".join(parts)


def text_tokens(model: str, args: tuple, kwargs: dict) -> int | None:
    if model == "qwen-image":
        t = kwargs.get("encoder_hidden_states")
        return int(t.shape[1]) if isinstance(t, torch.Tensor) else None
    if len(args) >= 3 and isinstance(args[2], list) and args[2] and isinstance(args[2][0], torch.Tensor):
        return int(args[2][0].shape[0])
    return None


def rnd(x: float | None, n: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), n)


def err_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    root = exc.__cause__ or exc.__context__
    if root is not None and root is not exc:  # e.g. capture_end failing after the real error
        text += f" (after {type(root).__name__}: {str(root).strip()})".replace("\n", " ")
    return text if len(text) < 400 else text[:397] + "..."


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_steps(self, fn: Callable[[], Any], repeats: int, warmup: int) -> tuple[float, float, float]:
        """(median step ms, median host ms, min step ms): each call timed alone, from idle."""
        for _ in range(warmup):
            fn()
        self.sync()
        steps, hosts = [], []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                t1 = time.perf_counter()
                end.synchronize()
                steps.append(start.elapsed_time(end))
                hosts.append((t1 - t0) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
                steps.append(ms)
                hosts.append(ms)
            self.sync()
        return statistics.median(steps), statistics.median(hosts), min(steps)

    def back_to_back(self, fn: Callable[[], Any], n: int, busy: bool) -> tuple[float, float | None, str | None]:
        """(wall ms per call over n back-to-back calls, GPU-busy fraction or None, why None)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        seq_ms = (time.perf_counter() - t0) / n * 1e3
        if not busy:
            return seq_ms, None, None
        if not self.cuda:
            return seq_ms, None, "no GPU"
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                self.sync()
                wall_ns = (time.perf_counter() - t0) * 1e9
            gpu_ns = _gpu_busy_ns(prof)
            if not gpu_ns:
                return seq_ms, None, "the profiler recorded no GPU activity"
            return seq_ms, min(1.0, gpu_ns / wall_ns), None
        except Exception as exc:  # the profiler is a nicety, never a failure of the variant
            return seq_ms, None, f"profiler failed: {err_text(exc)}"


def _gpu_busy_ns(prof: Any) -> int:
    """Union of the GPU intervals (kernels, copies, sets) the profiler saw, in ns."""
    intervals: list[tuple[int, int]] = []
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA and "sync" not in e.name().lower():
                intervals.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    except Exception:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                intervals.append((int(e.time_range.start * 1e3), int(e.time_range.end * 1e3)))
    intervals.sort()
    total, cur_s, cur_e = 0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class MemWatch:
    """Peak and growth of device memory over a block (reset at its start); no-op on CPU."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __enter__(self) -> "MemWatch":
        if self.clock.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.clock.device)
            self.base = torch.cuda.memory_allocated(self.clock.device)
            self.reserved0 = torch.cuda.memory_reserved(self.clock.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def numbers(self) -> dict[str, float | None]:
        """Read while the variant's objects (graphs, compiled code) are still alive."""
        if not self.clock.cuda:
            return {}
        dev = self.clock.device
        peak = torch.cuda.max_memory_allocated(dev)
        return {
            "peak_mb": rnd(peak / MiB, 1),
            "peak_over_base_mb": rnd((peak - self.base) / MiB, 1),
            "reserved_growth_mb": rnd((torch.cuda.memory_reserved(dev) - self.reserved0) / MiB, 1),
        }


def free_memory(clock: Clock) -> None:
    if clock.cuda:
        gc.collect()
        torch.cuda.synchronize(clock.device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Model settings
# ------------------------------------------------------------------------------------------------
def uses_cfg(model: str) -> bool:
    return model == "qwen-image"  # Z-Image runs as Turbo: guidance 0, one call per step


def steps_of(model: str, args: argparse.Namespace) -> int:
    return ZIMAGE_STEPS if model == "z-image" else args.steps_e2e


def calls_per_step(model: str) -> int:
    return 2 if uses_cfg(model) else 1


def pipe_kwargs(model: str, wh: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(prompt=PROMPT, width=wh[0], height=wh[1], num_inference_steps=steps_of(model, args))
    if model == "z-image":
        kw["guidance_scale"] = 0.0
    elif model == "qwen-image":
        kw.update(negative_prompt=NEGATIVE, true_cfg_scale=QWEN_TRUE_CFG)
    return kw


def register_recipes() -> None:
    """Recipes are found through entry points once the project is installed; a plain checkout
    (PYTHONPATH) has none, so register them by hand. Harmless when installed."""
    try:
        from accel.recipe import register_recipe
        from pipelines.qwen_image import QwenImageRecipe
        from pipelines.z_image import ZImageRecipe

        register_recipe(QwenImageRecipe)
        register_recipe(ZImageRecipe)
    except Exception as exc:
        say(f"warning: could not register the recipes by hand ({err_text(exc)})")


def accelerate(pipe: Any, **options: Any) -> Any:
    try:
        from accel import accelerate_pipeline
    except ImportError:
        from accel.pipeline import accelerate_pipeline
    return accelerate_pipeline(pipe, **options)


def denoiser_name(accel: Any) -> str:
    names = list(accel.runners)
    return "transformer" if "transformer" in names else names[0]


class _Stop(Exception):
    pass


def record_step0_calls(pipe: Any, model: str, wh: tuple[int, int], args: argparse.Namespace,
                       device: torch.device) -> list[tuple[tuple, dict]]:
    """Every ``pipe.transformer`` call of step 0 of a real pipeline run, arguments cloned."""
    calls: list[tuple[tuple, dict]] = []

    def pre_hook(module: Any, a: tuple, k: dict) -> None:
        calls.append((clone_tree(a), clone_tree(k)))

    def stop(pipe_: Any, i: int, t: Any, cb_kwargs: dict) -> dict:
        raise _Stop

    handle = pipe.transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(**pipe_kwargs(model, wh, args), generator=torch.Generator(device).manual_seed(SEED),
                 output_type="latent", callback_on_step_end=stop)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not calls:
        raise RuntimeError("the pipeline made no transformer call in step 0")
    return calls


# ------------------------------------------------------------------------------------------------
# Benchmark of one model
# ------------------------------------------------------------------------------------------------
def new_row(model: str, wh: tuple[int, int], variant: str) -> dict[str, Any]:
    return {
        "model": model, "resolution": res_name(wh), "width": wh[0], "height": wh[1], "variant": variant,
        "status": "skipped", "reason": "not run",
        "step_ms": None, "step_min_ms": None, "host_ms": None, "seq_ms": None, "speedup_vs_eager": None,
        "gpu_busy": None, "capture_s": None, "compile_s": None,
        "peak_mb": None, "peak_over_base_mb": None, "reserved_growth_mb": None, "graph_mb": None,
        "activation_mb": None, "out_max_abs_diff": None,
        "e2e_s": None, "e2e_per_step_ms": None, "e2e_speedup_vs_eager": None,
        "variant_wall_s": None, "notes": [],
    }


class ModelBench:
    def __init__(self, pipe: Any, model: str, args: argparse.Namespace, device: torch.device) -> None:
        self.pipe = pipe
        self.model = model
        self.args = args
        self.device = device
        self.clock = Clock(device)
        self.cfg = uses_cfg(model)
        self.activation_mb: dict[tuple[int, int], float] = {}
        self.calls: dict[tuple[int, int], tuple[tuple, dict]] = {}

    # -- one case ------------------------------------------------------------------------------
    def run_case(self, wh: tuple[int, int]) -> list[dict[str, Any]]:
        rows = {v: new_row(self.model, wh, v) for v in self.args.variants}
        try:
            calls = record_step0_calls(self.pipe, self.model, wh, self.args, self.device)
        except Exception as exc:
            traceback.print_exc()
            for r in rows.values():
                r.update(status="error", reason=f"recording the denoiser call failed: {err_text(exc)}")
            return list(rows.values())
        args, kwargs = calls[0]
        self.calls[wh] = (args, kwargs)
        meta = {
            "call": describe_call(args, kwargs),
            "calls_per_step": len(calls),
            "text_tokens": [text_tokens(self.model, a, k) for a, k in calls],
        }
        say(f"{self.model} {res_name(wh)}: step 0 makes {len(calls)} call(s); benchmarking the first: {meta['call']}")
        ctx: dict[str, Any] = {"args": args, "kwargs": kwargs}
        e2e = wh in self.args.e2e_resolutions
        for variant in self.args.variants:
            row = rows[variant]
            row.update(meta)
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    getattr(self, "v_" + variant.replace("-", "_"))(row, ctx, wh, e2e)
            except Exception as exc:
                traceback.print_exc()
                row.update(status="error", reason=err_text(exc))
            finally:
                try:
                    if "accel" in self.pipe.__dict__:
                        self.pipe.accel.restore()
                    free_memory(self.clock)
                except Exception as exc:
                    traceback.print_exc()
                    row["notes"].append(f"cleanup failed: {err_text(exc)}")
            row["variant_wall_s"] = rnd(time.perf_counter() - t0, 2)
            say(f"{self.model} {res_name(wh)} {variant:<10} {summary(row)}")
        eager = rows["eager"]
        for r in rows.values():
            if r["status"] == "ok" and eager["status"] == "ok":
                if r["step_ms"]:
                    r["speedup_vs_eager"] = rnd(eager["step_ms"] / r["step_ms"], 3)
                if r["e2e_s"] and eager["e2e_s"]:
                    r["e2e_speedup_vs_eager"] = rnd(eager["e2e_s"] / r["e2e_s"], 3)
        return list(rows.values())

    def _stock(self, ctx: dict) -> Callable[[], Any]:
        a, k = ctx["args"], ctx["kwargs"]
        transformer = self.pipe.transformer
        return lambda: transformer(*a, **k)

    def _ok(self, row: dict, t: tuple[float, float, float]) -> None:
        row.update(status="ok", reason=None, step_ms=rnd(t[0]), host_ms=rnd(t[1]), step_min_ms=rnd(t[2]))

    def _diff(self, row: dict, ctx: dict, out: Any) -> None:
        if "ref" in ctx:
            row["out_max_abs_diff"] = rnd(max_abs_diff(out, ctx["ref"]), 6)

    def _busy(self, row: dict, fn: Callable[[], Any]) -> None:
        seq_ms, busy, why = self.clock.back_to_back(fn, self.args.seq_calls, busy=not self.args.no_busy)
        row["seq_ms"] = rnd(seq_ms)
        row["gpu_busy"] = rnd(busy, 3)
        if why and not self.args.no_busy and self.clock.cuda:
            row["notes"].append(f"gpu_busy: {why}")

    # -- variants ------------------------------------------------------------------------------
    def v_eager(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool) -> None:
        assert "accel" not in self.pipe.__dict__, "the eager variant must see the stock pipeline"
        fn = self._stock(ctx)
        with MemWatch(self.clock) as mem:
            t = self.clock.time_steps(fn, self.args.repeats, self.args.warmup_calls)
            row.update(mem.numbers())
        self._ok(row, t)
        # Activation peak of one forward (for the memory-vs-resolutions comparison).
        if self.clock.cuda:
            free_memory(self.clock)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            out = fn()
            self.clock.sync()
            row["activation_mb"] = rnd((torch.cuda.max_memory_allocated(self.device) - before) / MiB, 1)
            self.activation_mb[wh] = row["activation_mb"]
        else:
            out = fn()
        ctx["ref"] = clone_tree(tensors_of(out))
        del out
        self._busy(row, fn)
        if e2e:
            self._e2e(row, ctx, wh, "eager")

    def v_bcg_exact(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool) -> None:
        """bcg without text padding: one graph per exact text length (Qwen-Image: no mask)."""
        self.v_bcg(row, ctx, wh, False, text_buckets=None)

    def v_bcg(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool, **options: Any) -> None:
        with MemWatch(self.clock) as mem:
            accelerate(self.pipe, **options)
            accel = self.pipe.accel
            self.clock.sync()
            t0 = time.perf_counter()
            report = accel.warmup([wh], prompts=[PROMPT], negative_prompt=NEGATIVE if self.cfg else None,
                                  cfg=self.cfg, progress=False)
            self.clock.sync()
            row["capture_s"] = rnd(time.perf_counter() - t0, 3)
            row["captures"] = report.total_captures
            row["graph_mb"] = rnd(accel.graph_memory_bytes() / MiB, 1)
            name = denoiser_name(accel)
            st0 = accel.stats()[name]
            row["capture_only_s"] = rnd(st0.capture_seconds, 3)
            row["segments_per_graph"] = st0.segments_per_entry
            fn = self._stock(ctx)  # pipe.transformer(...) -> diffusers hook -> runner replay
            t = self.clock.time_steps(fn, self.args.repeats, self.args.warmup_calls)
            st1 = accel.stats()[name]
            row.update(mem.numbers())
        self._ok(row, t)
        row["replays"] = st1.replays - st0.replays
        row["eager_fallbacks"] = st1.eager_calls - st0.eager_calls
        blocked = sorted(set(accel.runners[name].blocked.values()))
        if blocked:
            row["notes"].append("capture failed: " + "; ".join(blocked))
        if not self.clock.cuda:
            row["notes"].append("no CUDA: the runner runs the stock forward eagerly (0 graphs)")
        elif row["replays"] == 0:
            row["notes"].append("no graph replayed: the benchmarked call ran eagerly")
        self._diff(row, ctx, fn())
        self._busy(row, fn)
        if e2e:
            self._e2e(row, ctx, wh, "bcg")

    def v_graph(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool) -> None:
        if not self.clock.cuda:
            row.update(status="skipped", reason="needs CUDA (torch.cuda.CUDAGraph)")
            return
        from accel.pool import GraphPool

        fn = self._stock(ctx)
        with MemWatch(self.clock) as mem:
            pool = GraphPool(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                t0 = time.perf_counter()
                caller = torch.cuda.current_stream(self.device)
                pool.stream.wait_stream(caller)
                with torch.cuda.stream(pool.stream):
                    for _ in range(2):
                        fn()
                caller.wait_stream(pool.stream)
                self.clock.sync()
                try:
                    with torch.cuda.graph(graph, pool=pool.handle, stream=pool.stream):
                        static_out = fn()
                except Exception as exc:
                    row.update(status="error", reason=f"whole-forward capture failed: {err_text(exc)}")
                    say(f"{self.model} {res_name(wh)} graph: capture failed (expected for some calls): {row['reason']}")
                    return
                self.clock.sync()
                row["capture_s"] = rnd(time.perf_counter() - t0, 3)
                t = self.clock.time_steps(graph.replay, self.args.repeats, self.args.warmup_calls)
                row["graph_mb"] = rnd(pool.resident_bytes() / MiB, 1)
                row.update(mem.numbers())
                self._ok(row, t)
                graph.replay()
                self._diff(row, ctx, static_out)
                row["notes"].append("replay only: no input copy, output not cloned")
            finally:
                with contextlib.suppress(Exception):
                    self.clock.sync()
                with contextlib.suppress(Exception):
                    graph.reset()
                del graph, pool

    def _compile(self, row: dict, ctx: dict, wh: tuple[int, int], mode: str | None) -> None:
        ro = mode == "reduce-overhead"
        if ro and not self.clock.cuda:
            row.update(status="skipped", reason="needs CUDA (reduce-overhead uses CUDA graphs)")
            return
        if not self.clock.cuda and self.args.smoke:
            row.update(status="skipped", reason="smoke mode on CPU: inductor needs a C++ toolchain and tens of "
                                                 "seconds per shape; run without --smoke to try it")
            return
        from torch import _dynamo

        _dynamo.reset()
        a, k = ctx["args"], ctx["kwargs"]
        compiled = torch.compile(self.pipe.transformer, mode=mode, dynamic=False)
        try:
            def fn() -> Any:
                if ro:
                    torch.compiler.cudagraph_mark_step_begin()
                    return clone_tree(compiled(*a, **k))  # its outputs live in the graph's pool
                return compiled(*a, **k)

            with MemWatch(self.clock) as mem:
                self.clock.sync()
                t0 = time.perf_counter()
                fn()
                self.clock.sync()
                row["compile_s"] = rnd(time.perf_counter() - t0, 2)
                t = self.clock.time_steps(fn, self.args.repeats, self.args.warmup_calls)
                row.update(mem.numbers())
            self._ok(row, t)
            self._diff(row, ctx, fn())
            row["seq_ms"] = rnd(self.clock.back_to_back(fn, self.args.seq_calls, busy=False)[0])
        finally:
            del compiled
            _dynamo.reset()
            with contextlib.suppress(Exception):
                from torch._inductor import cudagraph_trees

                cudagraph_trees.reset_cudagraph_trees()

    def v_compile(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool) -> None:
        self._compile(row, ctx, wh, None)

    def v_compile_ro(self, row: dict, ctx: dict, wh: tuple[int, int], e2e: bool) -> None:
        self._compile(row, ctx, wh, "reduce-overhead")

    # -- end to end ----------------------------------------------------------------------------
    def _e2e(self, row: dict, ctx: dict, wh: tuple[int, int], variant: str) -> None:
        """Full pipeline call (output decoded to PIL), median of runs after one warm-up run."""
        steps = steps_of(self.model, self.args)
        final: dict[str, torch.Tensor] = {}

        def keep(pipe_: Any, i: int, t: Any, cb_kwargs: dict) -> dict:
            final["latents"] = cb_kwargs["latents"]
            return {}

        def once() -> float:
            g = torch.Generator(self.device).manual_seed(SEED)
            self.clock.sync()
            t0 = time.perf_counter()
            self.pipe(**pipe_kwargs(self.model, wh, self.args), generator=g, output_type="pil", callback_on_step_end=keep)
            self.clock.sync()
            return time.perf_counter() - t0

        try:
            stats0 = self.pipe.accel.stats()[denoiser_name(self.pipe.accel)] if variant == "bcg" else None
            if self.clock.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            row["e2e_first_s"] = rnd(once(), 3)
            times = [once() for _ in range(self.args.e2e_runs)]
            e2e_s = statistics.median(times)
            row.update(e2e_s=rnd(e2e_s, 4), e2e_steps=steps, e2e_calls_per_step=calls_per_step(self.model),
                       e2e_per_step_ms=rnd(e2e_s / steps * 1e3, 2), e2e_runs=len(times))
            if self.clock.cuda:
                row["e2e_peak_mb"] = rnd(torch.cuda.max_memory_allocated(self.device) / MiB, 1)
            latents = final["latents"].detach().clone()
            if variant == "eager":
                ctx["e2e_latents"] = latents
            else:
                stats1 = self.pipe.accel.stats()[denoiser_name(self.pipe.accel)]
                row["e2e_graph_misses"] = stats1.misses - stats0.misses
                row["e2e_eager_calls"] = stats1.eager_calls - stats0.eager_calls
                ref = ctx.get("e2e_latents")
                if ref is not None:
                    row["e2e_bit_equal"] = bool(torch.equal(latents, ref))
                    row["e2e_max_abs_diff"] = rnd(float((latents.float() - ref.float()).abs().max()), 6)
        except Exception as exc:  # the step numbers stand; say why end to end is missing
            traceback.print_exc()
            row["e2e_error"] = err_text(exc)
            row["notes"].append(f"end to end failed: {row['e2e_error']}")

    # -- memory vs number of captured resolutions ----------------------------------------------
    def memory_series(self) -> list[dict[str, Any]]:
        n = self.args.series_count
        if n <= 0 or "bcg" not in self.args.variants:
            return []
        res = sorted(self.calls, key=lambda wh: wh[0] * wh[1], reverse=True)[:n]
        if not res:
            return []
        out: list[dict[str, Any]] = []
        free_memory(self.clock)
        try:
            with torch.no_grad():
                accelerate(self.pipe)
                total_peaks: float | None = 0.0
                done: list[str] = []
                for i, wh in enumerate(res, 1):
                    self.clock.sync()
                    t0 = time.perf_counter()
                    report = self.pipe.accel.warmup([wh], prompts=[PROMPT], negative_prompt=NEGATIVE if self.cfg else None,
                                                    cfg=self.cfg, progress=False)
                    self.clock.sync()
                    done.append(res_name(wh))
                    peak = self.activation_mb.get(wh)
                    total_peaks = None if peak is None or total_peaks is None else total_peaks + peak
                    entry = {
                        "model": self.model, "n_resolutions": i, "added": res_name(wh), "resolutions": list(done),
                        "warmup_s": rnd(time.perf_counter() - t0, 3), "captures": report.total_captures,
                        "graph_mb": rnd(self.pipe.accel.graph_memory_bytes() / MiB, 1),
                        "pool_mb": rnd((self.pipe.accel.pool.resident_bytes() if self.pipe.accel.pool else 0) / MiB, 1),
                        "eager_activation_mb": peak, "sum_eager_activation_mb": rnd(total_peaks, 1),
                    }
                    out.append(entry)
                    say(f"{self.model} memory series: +{res_name(wh)} -> graph {entry['graph_mb']} MiB "
                        f"(sum of eager activation peaks {entry['sum_eager_activation_mb']} MiB)")
        except Exception as exc:
            traceback.print_exc()
            out.append({"model": self.model, "n_resolutions": len(out) + 1, "error": err_text(exc)})
        finally:
            if "accel" in self.pipe.__dict__:
                self.pipe.accel.restore()
            free_memory(self.clock)
        return out


def summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['reason']}"
    parts = [f"step {row['step_ms']:.2f} ms", f"host {row['host_ms']:.2f} ms"]
    for key, label, unit in (("capture_s", "capture", "s"), ("compile_s", "compile", "s"), ("graph_mb", "graph", "MiB"),
                             ("peak_over_base_mb", "peak+", "MiB"), ("gpu_busy", "busy", ""), ("e2e_s", "e2e", "s"),
                             ("out_max_abs_diff", "diff", "")):
        if row.get(key) is not None:
            parts.append(f"{label} {row[key]}{(' ' + unit) if unit else ''}")
    if row.get("e2e_bit_equal") is not None:
        parts.append("e2e bit-equal" if row["e2e_bit_equal"] else f"e2e max diff {row['e2e_max_abs_diff']}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_markdown(results: dict, path: Path) -> None:
    env, cfg = results["env"], results["config"]
    L: list[str] = ["# bcg-diffusers benchmark", ""]
    L.append(f"**Device:** {env['device_name']} ({env['device']}"
             + (f", driver {env['driver']}, CUDA {env['cuda']}" if env["device"] == "cuda" else "") + ")  ")
    L.append(f"**Versions:** torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
             f"python {env['python']}; bcg-diffusers {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}  ")
    when = "merged runs (below)" if results.get("runs") else env["date"]
    e2e = (f", end to end: median of {cfg['e2e_runs']} runs after 1 warm-up" if cfg.get("e2e_resolutions")
           else ", no end-to-end runs")
    L.append(f"**Run:** {when}; size {cfg['size']}, dtype {cfg['dtype']}, {cfg['repeats']} timed calls after "
             f"{cfg['warmup_calls']} warm-up{e2e}{' (smoke)' if cfg['smoke'] else ''}; "
             f"total {results.get('elapsed_s', '-')} s")
    if results.get("runs"):
        L.append("")
        L.append(f"Merged from {len(results['runs'])} runs, one process each; all variants of one model and "
                 "resolution come from the same run:")
        L.append("")
        for i, run in enumerate(results["runs"]):
            L.append(f"- run {i}: {run['date']}, {' '.join(run['models'])} at {' '.join(run['resolutions'])}, "
                     f"variants {' '.join(run['variants'])}, {run.get('elapsed_s', '-')} s")
    L.append("")
    L.append("Step = one denoiser forward of step 0's first call, median; x = speed-up vs eager measured in the same "
             "process. Z-Image runs as Turbo (guidance 0, 9 steps); Qwen-Image with true CFG (2 calls per step, "
             f"{cfg['steps_e2e']} steps end to end, negative prompt), and bcg pads its text to a length bucket with a "
             "mask, so its output differs from the unpadded stock call by bf16 noise.")
    L.append("")
    cases = results["cases"]
    variants = cfg["variants"]
    for model in cfg["models"]:
        mrows = [r for r in cases if r["model"] == model]
        if not mrows:
            continue
        info = results.get("models", {}).get(model, {})
        L.append(f"## {model}" + (f" — {info['describe']}" if info.get("describe") else ""))
        L.append("")
        resolutions = list(dict.fromkeys(r["resolution"] for r in mrows))
        by = {(r["resolution"], r["variant"]): r for r in mrows}

        L.append("### Denoiser step, ms (speed-up vs eager)")
        L.append("")
        L.append("| resolution | " + " | ".join(variants) + " | GPU busy eager | GPU busy bcg |")
        L.append("|---|" + "---|" * (len(variants) + 2))
        for res in resolutions:
            cells = []
            for v in variants:
                r = by.get((res, v))
                if r is None:
                    cells.append("-")
                elif r["status"] != "ok":
                    cells.append(r["status"])
                elif v == "eager":
                    cells.append(f"{r['step_ms']:.2f}")
                else:
                    cells.append(f"{r['step_ms']:.2f} ({_f(r['speedup_vs_eager'])}x)")
            busy = [by.get((res, v), {}).get("gpu_busy") for v in ("eager", "bcg")]
            L.append(f"| {res} | " + " | ".join(cells) + " | " + " | ".join(_f(b, "{:.0%}") for b in busy) + " |")
        L.append("")

        L.append("### Host time per call (ms), setup cost (s), memory (MiB)")
        L.append("")
        L.append("| resolution | variant | host ms | back-to-back ms | capture / compile s | graph MiB | peak over weights MiB | "
                 "eager activation MiB | out max diff vs eager |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for res in resolutions:
            for v in variants:
                r = by.get((res, v))
                if r is None or r["status"] != "ok":
                    continue
                setup = r.get("capture_s") if r.get("capture_s") is not None else r.get("compile_s")
                L.append(f"| {res} | {v} | {_f(r['host_ms'])} | {_f(r['seq_ms'])} | {_f(setup)} | {_f(r['graph_mb'], '{:.1f}')} | "
                         f"{_f(r['peak_over_base_mb'], '{:.1f}')} | {_f(r['activation_mb'], '{:.1f}')} | "
                         f"{_f(r['out_max_abs_diff'], '{:.3g}')} |")
        L.append("")

        compiled = [v for v in ("compile", "compile-ro") if any(by.get((res, v), {}).get("compile_s") for res in resolutions)]
        if compiled and "bcg" in variants:
            L.append("### Setup cost: bcg capture vs torch.compile's first call, s")
            L.append("")
            L.append("| resolution | bcg capture | " + " | ".join(f"{v} first call | {v} / capture" for v in compiled) + " |")
            L.append("|---|---|" + "---|---|" * len(compiled))
            for res in resolutions:
                cap = by.get((res, "bcg"), {}).get("capture_s")
                cells = [_f(cap)]
                for v in compiled:
                    c = by.get((res, v), {}).get("compile_s")
                    cells += [_f(c, "{:.1f}"), f"{c / cap:.0f}x" if c and cap else "-"]
                L.append(f"| {res} | " + " | ".join(cells) + " |")
            L.append("")
            L.append("compile-ro runs right after compile at the same resolution in the same process and reuses the "
                     "kernels built there, and later resolutions of a run reuse kernels of earlier ones, so these first "
                     "calls, compile-ro's above all, are lower bounds of cold ones. bcg capture likewise follows "
                     "earlier captures of the run.")
            L.append("")

        e2e_rows = [r for r in mrows if r.get("e2e_s") is not None or r.get("e2e_error")]
        if e2e_rows:
            L.append("### End to end (full pipeline call, decoded image)")
            L.append("")
            L.append("| resolution | variant | steps x calls | e2e s | per step ms | speed-up | first run s | output vs eager |")
            L.append("|---|---|---|---|---|---|---|---|")
            for r in e2e_rows:
                if r.get("e2e_s") is None:
                    L.append(f"| {r['resolution']} | {r['variant']} | - | error | - | - | - | {r['e2e_error']} |")
                    continue
                if r["variant"] == "eager":
                    match = "reference"
                elif r.get("e2e_bit_equal"):
                    match = "bit-equal"
                elif r.get("e2e_max_abs_diff") is not None:
                    match = f"max abs diff {r['e2e_max_abs_diff']:.3g}"
                else:
                    match = "-"
                L.append(f"| {r['resolution']} | {r['variant']} | {r['e2e_steps']} x {r['e2e_calls_per_step']} | "
                         f"{r['e2e_s']:.3f} | {_f(r['e2e_per_step_ms'])} | {_f(r['e2e_speedup_vs_eager'])}x | "
                         f"{_f(r.get('e2e_first_s'), '{:.3f}')} | {match} |")
            L.append("")

        series = [s for s in results.get("memory_series", []) if s["model"] == model]
        if series:
            L.append("### Graph memory vs number of captured resolutions (one accelerated pipeline)")
            L.append("")
            L.append("| captured | added | warm-up s | graph MiB | sum of eager activation peaks MiB |")
            L.append("|---|---|---|---|---|")
            for s in series:
                if "error" in s:
                    L.append(f"| {s['n_resolutions']} | error | - | - | {s['error']} |")
                else:
                    L.append(f"| {s['n_resolutions']} | {s['added']} | {_f(s['warmup_s'])} | {_f(s['graph_mb'], '{:.1f}')} | "
                             f"{_f(s['sum_eager_activation_mb'], '{:.1f}')} |")
            L.append("")

        notes = [r for r in mrows if r["status"] != "ok" or r["notes"]]
        if notes:
            L.append("### Notes, skips and errors")
            L.append("")
            for r in notes:
                text = r["reason"] if r["status"] != "ok" else "; ".join(r["notes"])
                L.append(f"- {r['resolution']} {r['variant']} ({r['status']}): {text}")
            L.append("")

    plots = results.get("plots", {})
    if plots:
        L.append("## Plots")
        L.append("")
        for name, status in plots.items():
            L.append(f"![{name}]({name})" if status == "ok" else f"- {name}: {status}")
        L.append("")
    L.append("Method: see the docstring of scripts/bench.py. Host ms = wall time until the call returns; step ms = "
             "CUDA-event time of the call from an idle GPU; back-to-back ms = wall time per call in a sequence; "
             "GPU busy = union of the profiler's GPU activity over that sequence's wall time (profiler overhead "
             "included, so eager's figure is a lower bound). Graph MiB for bcg = shared pool + static inputs + "
             "boundary buffers; for graph = its private pool.")
    path.write_text("\n".join(L) + "\n")


def write_plots(results: dict, out: Path) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return {name: f"skipped: matplotlib unavailable ({err_text(exc)})" for name in PLOTS}
    status: dict[str, str] = {}
    models = [m for m in results["config"]["models"] if any(r["model"] == m for r in results["cases"])] or ["-"]

    try:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            rows = [r for r in results["cases"] if r["model"] == model]
            ress = sorted(dict.fromkeys((r["width"], r["height"]) for r in rows), key=lambda wh: wh[0] * wh[1])
            for v in results["config"]["variants"]:
                pts = sorted(((r["width"] * r["height"] / 1e6, r["step_ms"]) for r in rows
                              if r["variant"] == v and r["status"] == "ok"), key=lambda p: p[0])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
            ax.set_xticks([w * h / 1e6 for w, h in ress])
            ax.set_xticklabels([f"{w}x{h}" for w, h in ress], rotation=30, fontsize=8)
            ax.set_xlabel("resolution (x: megapixels)")
            ax.set_ylabel("denoiser step, ms (median)")
            ax.set_title(model)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        env = results["env"]
        fig.suptitle(f"step time per variant - {env['device_name']}, torch {env['torch']}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "step_time.png", dpi=110)
        plt.close(fig)
        status["step_time.png"] = "ok"
    except Exception as exc:
        status["step_time.png"] = f"error: {err_text(exc)}"

    if not results.get("memory_series"):
        status["graph_memory.png"] = "skipped: no memory series in these results (--series-count 0)"
        return status
    try:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            series = [s for s in results.get("memory_series", []) if s["model"] == model and "error" not in s]
            if series:
                x = [s["n_resolutions"] for s in series]
                ax.plot(x, [s["graph_mb"] for s in series], marker="o", label="bcg graph memory (one shared pool)")
                sums = [s["sum_eager_activation_mb"] for s in series]
                if all(v is not None for v in sums):
                    ax.plot(x, sums, marker="s", linestyle="--", label="sum of eager activation peaks")
                ax.set_xticks(x)
                ax.set_xticklabels([f"{s['n_resolutions']}\n+{s['added']}" for s in series], fontsize=8)
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no series", ha="center", va="center", transform=ax.transAxes)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("captured resolutions (cumulative)")
            ax.set_ylabel("MiB")
            ax.set_title(model)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "graph_memory.png", dpi=110)
        plt.close(fig)
        status["graph_memory.png"] = "ok"
    except Exception as exc:
        status["graph_memory.png"] = f"error: {err_text(exc)}"
    return status


MERGE_SAME_ENV = ("device", "device_name", "driver", "torch", "diffusers", "transformers")
MERGE_SAME_CONFIG = ("size", "dtype")


def _by_area(wh: tuple[int, int]) -> tuple[int, int]:
    return wh[0] * wh[1], wh[0]


def merge_results(parts: list[dict]) -> dict:
    """One report from runs made in separate processes on one machine setup.

    Refuses runs from different devices or versions, and a (model, resolution) measured in two runs:
    its variants would then be compared across processes, and every ratio here is meant to be one
    measured inside a single process.
    """
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts[1:], 1):
        for key in MERGE_SAME_ENV:
            if part["env"].get(key) != first["env"].get(key):
                raise ValueError(f"run {i} differs in env {key}: {part['env'].get(key)!r} vs {first['env'].get(key)!r}")
        for key in MERGE_SAME_CONFIG:
            if part["config"].get(key) != first["config"].get(key):
                raise ValueError(f"run {i} differs in config {key}: "
                                 f"{part['config'].get(key)!r} vs {first['config'].get(key)!r}")
    owner: dict[tuple[str, str], int] = {}
    for i, part in enumerate(parts):
        for key in dict.fromkeys((c["model"], c["resolution"]) for c in part["cases"]):
            if key in owner:
                raise ValueError(f"{key[0]} {key[1]} was measured in run {owner[key]} and in run {i}")
            owner[key] = i

    models = list(dict.fromkeys(m for p in parts for m in p["config"]["models"]))
    cases = [dict(c, run=i) for i, p in enumerate(parts) for c in p["cases"]]
    cases.sort(key=lambda c: (models.index(c["model"]), _by_area((c["width"], c["height"])), VARIANTS.index(c["variant"])))
    config = dict(first["config"])
    config.update(
        models=models,
        resolutions=sorted(dict.fromkeys(r for p in parts for r in p["config"]["resolutions"]),
                           key=lambda r: _by_area(parse_resolution(r))),
        variants=[v for v in VARIANTS if any(v in p["config"]["variants"] for p in parts)],
        e2e_resolutions=list(dict.fromkeys(r for p in parts for r in p["config"].get("e2e_resolutions", []))),
    )
    runs = [{"date": p["env"]["date"], "elapsed_s": p.get("elapsed_s"), "models": p["config"]["models"],
             "resolutions": p["config"]["resolutions"], "variants": p["config"]["variants"]} for p in parts]
    info: dict[str, Any] = {}
    for p in parts:
        for model, m in p.get("models", {}).items():
            info.setdefault(model, {k: v for k, v in m.items() if k == "describe"})
    elapsed = [p.get("elapsed_s") for p in parts]
    return {"env": dict(first["env"]), "config": config, "models": info, "cases": cases,
            "memory_series": [s for p in parts for s in p.get("memory_series", [])], "runs": runs,
            "elapsed_s": rnd(sum(elapsed), 1) if all(e is not None for e in elapsed) else None}


def save(results: dict, out: Path, plots: bool) -> None:
    if "runs" not in results:  # a merge keeps its runs' own times
        results["elapsed_s"] = rnd(time.perf_counter() - T_START, 1)
    if plots:
        results["plots"] = write_plots(results, out)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "results.json")
    write_markdown(results, out / "results.md")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        try:
            parts = [json.loads((Path(d) / "results.json").read_text()) for d in args.merge]
            merged = merge_results(parts)
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"--merge: {err_text(exc)}") from None
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save(merged, out, plots=True)
        say(f"merged {len(parts)} runs, {len(merged['cases'])} cases into {out / 'results.json'}")
        return 0
    args = resolve_config(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import diffusers.utils.logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_compile_cache:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    clock = Clock(device)

    from pipelines.builders import build_pipeline, canonical_name, describe

    register_recipes()
    models = [canonical_name(m) or m for m in args.models]
    args.models = list(dict.fromkeys(models))
    env = collect_env(device)
    config = {k: v for k, v in vars(args).items()}
    config["resolutions"] = [res_name(r) for r in args.resolutions]
    config["e2e_resolutions"] = [res_name(r) for r in args.e2e_resolutions]
    config.update(prompt=PROMPT, negative_prompt=NEGATIVE, seed=SEED, zimage_steps=ZIMAGE_STEPS,
                  zimage_guidance=0.0, qwen_true_cfg_scale=QWEN_TRUE_CFG)
    results: dict[str, Any] = {"env": env, "config": config, "models": {}, "cases": [], "memory_series": []}
    say(f"device {env['device_name']} | torch {env['torch']} | diffusers {env['diffusers']} | "
        f"transformers {env['transformers']} | variants {' '.join(args.variants)} | "
        f"resolutions {' '.join(config['resolutions'])} | e2e at {' '.join(config['e2e_resolutions']) or 'none'}")

    for model in args.models:
        t_model = time.perf_counter()
        pipe = bench = None
        try:
            pipe = build_pipeline(model, size=args.size, device=device, dtype=dtype, seed=SEED)
            pipe.set_progress_bar_config(disable=True)
            results["models"][model] = {"describe": describe(pipe), "build_s": rnd(time.perf_counter() - t_model, 1)}
            say(f"built {describe(pipe)} in {time.perf_counter() - t_model:.1f} s")
        except Exception as exc:
            traceback.print_exc()
            reason = f"building the pipeline failed: {err_text(exc)}"
            for wh in args.resolutions:
                for v in args.variants:
                    results["cases"].append({**new_row(model, wh, v), "status": "error", "reason": reason})
            save(results, out, plots=False)
            pipe = None
            free_memory(clock)
            continue
        try:
            bench = ModelBench(pipe, model, args, device)
            for wh in args.resolutions:
                t_case = time.perf_counter()
                results["cases"].extend(bench.run_case(wh))
                say(f"{model} {res_name(wh)}: case done in {time.perf_counter() - t_case:.1f} s")
                save(results, out, plots=False)
            results["memory_series"].extend(bench.memory_series())
        finally:
            del bench, pipe
            with contextlib.suppress(Exception):
                from torch import _dynamo

                _dynamo.reset()
            free_memory(clock)
            if clock.cuda:
                say(f"freed {model}: {torch.cuda.memory_allocated(device) / MiB:.0f} MiB still allocated")
        results["models"][model]["total_s"] = rnd(time.perf_counter() - t_model, 1)
        say(f"{model}: done in {time.perf_counter() - t_model:.1f} s")
        save(results, out, plots=True)

    save(results, out, plots=True)
    say(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots; total {time.perf_counter() - T_START:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
