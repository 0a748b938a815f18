"""The command line: options, their defaults per device, and the compile-cache folder."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from .registry import DEFAULT_CPU, DEFAULT_CUDA, VARIANTS
from .settings import parse_resolution


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark eager vs bcg vs one whole-forward CUDA graph vs torch.compile.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", nargs="+", default=["z-image", "qwen-image"], help="z-image, qwen-image, z-image-omni")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument(
        "--resolutions",
        nargs="+",
        type=parse_resolution,
        default=None,
        help="N or WxH (width x height); default 256 512 768 1024 768x512 (full), 64 96x64 (tiny)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=None,
        help="default on CUDA: eager bcg graph (compile variants are opt-in); smoke: all",
    )
    p.add_argument("--steps-e2e", type=int, default=None, help="Qwen-Image steps end to end (default 20; smoke 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed step calls per variant (default 10; smoke 3)")
    p.add_argument("--warmup-calls", type=int, default=None, help="untimed calls before timing (default 3; smoke 1)")
    p.add_argument("--seq-calls", type=int, default=None, help="back-to-back calls for GPU-busy (default 5; smoke 2)")
    p.add_argument(
        "--e2e-runs", type=int, default=None, help="timed end-to-end runs after one warm-up (default 3; smoke 1)"
    )
    p.add_argument(
        "--e2e-resolutions",
        nargs="+",
        type=parse_resolution,
        default=None,
        help="end-to-end at these of --resolutions (default 512 1024; tiny: the first)",
    )
    p.add_argument(
        "--series-count",
        type=int,
        default=3,
        help="memory series: warm up this many of the largest resolutions cumulatively (0: off)",
    )
    p.add_argument(
        "--inductor",
        nargs="+",
        type=_setting,
        default=[],
        metavar="NAME=VALUE",
        help="inductor settings of the bcg+compile-tuned variant (beside bcg+compile, in the same run), "
        "e.g. coordinate_descent_tuning=true",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        default=None,
        help="measure nothing: merge the results.json of earlier runs (e.g. one per device call) into "
        "one report under --out. Each model and resolution must come from a single run, so every "
        "ratio stays one measured inside one process; the one exception is a cold and a warm run "
        "of the same --compile-cache, kept side by side",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end pipeline runs")
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the timed end-to-end runs, one more run split into phases (text encoder, denoiser, rest of "
        "the loop, VAE decode, post-processing, other; CUDA events on GPU): on by default wherever end to end runs",
    )
    p.add_argument("--no-busy", action="store_true", help="skip the profiled GPU-busy measurement")
    p.add_argument(
        "--smoke", action="store_true", help="tiny models on CPU, 64 and 96x64, few repeats: runs in seconds (CI)"
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="disable inductor's on-disk caches (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), so a compile "
        "cannot read what an earlier one of the same run wrote",
    )
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        default=None,
        help="where inductor's and triton's on-disk caches live for this run (default: a fresh temporary "
        "folder, so compile times are cold). The run records whether DIR was empty at start (cold) "
        "or not (warm); run twice with the same DIR for cold and warm numbers, then --merge both",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; smoke: 1, the tiny models gain nothing from more)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's info messages")
    return p


def _setting(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> (name, value): true/false as bools, numbers as numbers, else the string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    for kind in (int, float):
        try:
            return name, kind(raw)
        except ValueError:
            pass
    return name, raw


def resolve_config(args: argparse.Namespace) -> argparse.Namespace:
    import torch

    smoke = args.smoke
    if args.device is None:
        args.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    if args.compile_cache and args.no_compile_cache:
        raise SystemExit("--compile-cache and --no-compile-cache exclude each other")
    cuda = args.device == "cuda"
    if args.size is None:
        args.size = "tiny" if smoke or not cuda else "full"
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.resolutions is None:
        args.resolutions = (
            [(64, 64), (96, 64)]
            if args.size == "tiny"
            else [(256, 256), (512, 512), (768, 768), (1024, 1024), (768, 512)]
        )
    args.resolutions = list(dict.fromkeys(args.resolutions))
    if args.variants is None:
        args.variants = list(VARIANTS) if smoke else list(DEFAULT_CUDA if cuda else DEFAULT_CPU)
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


@dataclasses.dataclass(frozen=True)
class CompileCache:
    folder: Path
    state: str  # "cold" (empty at start), "warm" or "disabled" (--no-compile-cache)
    temporary: bool


def setup_compile_cache(args: argparse.Namespace) -> CompileCache:
    """Point inductor's and triton's on-disk caches (and the library's, ``BCG_COMPILE_CACHE``) at
    the run's folder. Must run before anything imports diffusers or compiles."""
    if args.compile_cache:
        folder, temporary = Path(args.compile_cache).expanduser().resolve(), False
        warm = folder.is_dir() and any(folder.iterdir())
        folder.mkdir(parents=True, exist_ok=True)
    else:
        folder, temporary, warm = Path(tempfile.mkdtemp(prefix="bench-compile-cache-")), True, False
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    # The library's own layout (accel.hooks.compiled.compile.use_compile_cache), so --compile-cache can name its cache too.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    os.environ["BCG_COMPILE_CACHE"] = str(folder)
    if args.no_compile_cache:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    state = "disabled" if args.no_compile_cache else ("warm" if warm else "cold")
    return CompileCache(folder=folder, state=state, temporary=temporary)
