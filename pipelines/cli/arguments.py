"""Argument parsing: each value checked as it is read.

Nothing here imports torch, diffusers or accel's package: ``--help`` and a mistyped option
answer in a fraction of a second instead of the 3-5 s those imports take. The few constants the
parser needs come from ``accel/hooks/options.py`` (stdlib only), loaded on its own, and from
:mod:`pipelines.limits`, mirrored below and kept equal by a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import CLIError

PROG = "bcg-generate"
DEFAULT_PROMPT = "a red fox in the snow, golden hour"
DEFAULT_MODEL = "z-image"
DEFAULT_RESOLUTION = (512, 512)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip
CACHES = ("fbc", "taylorseer", "magcache", "dbcache")

# Mirrors of pipelines.limits (which imports torch); tests/pipelines/cli/test_startup.py keeps them equal.
MAX_SEED = 2**63 - 1
MAX_STEPS = 1000
MEMORY_MARGIN = 1.5


@cache
def accel_options() -> ModuleType:
    """``accel.hooks.options`` without running ``accel/__init__`` (which imports torch and diffusers).

    The file needs only the standard library, so it is executed on its own under a private name.
    Should it ever need the rest of accel, loading it alone fails and the real module is used:
    slower, never wrong.
    """
    real = sys.modules.get("accel.hooks.options")
    if real is not None:
        return real
    name = "pipelines.cli._accel_options"
    try:
        package = importlib.util.find_spec("accel")  # a top-level find_spec imports nothing
        locations = list(package.submodule_search_locations or []) if package else []
        spec = importlib.util.spec_from_file_location(name, Path(locations[0]) / "hooks" / "options.py")
        if spec is None or spec.loader is None:
            raise ImportError("accel/hooks/options.py not found")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module
    except Exception:
        sys.modules.pop(name, None)
        import accel.hooks.options

        return accel.hooks.options


def _resolution(text: str) -> tuple[int, int]:
    try:
        return accel_options().parse_resolution(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _warmup_item(text: str) -> tuple[int, int] | None:
    if text.strip().lower() == "none":
        return None
    return _resolution(text)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _steps(text: str) -> int:
    value = _int(text)
    # The same words as limits.check_steps, which checks again against the built scheduler.
    if not 1 <= value <= MAX_STEPS:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {MAX_STEPS}, the number of noise levels the scheduler was trained on "
            "(num_train_timesteps); more steps only repeat them"
        )
    return value


def _seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{value} is outside 0 to 2**63 - 1 ({MAX_SEED}); image i of a run uses seed + i"
        )
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the guidance scale must be a finite number, 0 or more")
    return value


def _positive(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0")
    return value


def _ratios(text: str) -> tuple[float, ...]:
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("is empty: give the calibrated ratios as R1,R2,... (one per step)")
    try:
        return tuple(_positive(t) for t in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"each ratio must be a finite number above 0; {e}") from None


def _user_path(text: str) -> str:
    """``text`` with a leading ``~`` expanded, as the shell does unless the path is quoted.

    Left as it was, ``--out "~/x.png"`` makes a folder named ``~`` in the current folder.
    """
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise argparse.ArgumentTypeError(f"{text!r}: {text.split(os.sep)[0]} is no user's home folder here")
    return expanded


def _path(text: str) -> Path:
    return Path(_user_path(text))


def _out_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder, or a .png file for a single image")
    if text.strip() == "-":
        raise argparse.ArgumentTypeError("'-': images are not written to stdout; name a .png file or a folder")
    return _path(text)


def check_utf8(text: str) -> str:
    """``text`` if it is valid UTF-8, else ArgumentTypeError naming the first bad byte.

    Arguments that are not UTF-8 reach Python as lone surrogates (PEP 383), which no tokenizer
    takes and no PNG text chunk can hold.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text ({what} at character {e.start})") from None
    return text


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt cannot be empty (leave --prompt out for the default prompt)")
    return check_utf8(text)


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is empty: name z-image, qwen-image, flux, wan, wan-1.3b, a pipeline folder or a hub id"
        )
    return _user_path(text)


def package_version() -> str:
    """bcg-diffusers' version, from the installed metadata (no torch import), else accel's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bcg-diffusers")
    except PackageNotFoundError:  # a source tree that was never installed
        from accel import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise CLIError(f"{message} (see {PROG} --help)")

    def _parse_optional(self, arg_string: str) -> Any:
        # The only short option is -h, so "-5x5" after --resolution or "-fox" after --prompt is a
        # value, never an option: without this, argparse says "expected one argument" and the
        # real mistake (a negative size) goes unnamed, or a prompt cannot start with "-".
        if arg_string.startswith("-") and not arg_string.startswith("--") and arg_string not in ("-", "-h"):
            return None
        return super()._parse_optional(arg_string)


def _compile_cache_line() -> str:
    options = accel_options()
    folder = options.default_compile_cache_dir()
    line = f"compile cache: --compile keeps compiled kernels in {folder}"
    env = os.environ.get(options.COMPILE_CACHE_ENV)
    if env and folder.exists() and not folder.is_dir():
        line += f"\n  (${options.COMPILE_CACHE_ENV} names a file, not a folder: --compile refuses it)"
    return line


def build_parser() -> argparse.ArgumentParser:
    """The ``bcg-generate`` argument parser."""
    options = accel_options()
    multiple = options.RESOLUTION_MULTIPLE
    p = _Parser(
        prog=PROG,
        description="Generate images with a diffusers pipeline whose denoiser replays breakable CUDA graphs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
limits (checked before the model runs or anything is written; see pipelines/limits.py):
  resolution  multiples of {multiple}, at most what the model's position table can place
              (z-image: 8192x8192, from its RoPE axes_lens [1024, 512, 512] at 16 pixels a token;
              qwen-image: 98320 a side, from its 4096-row RoPE table; flux and wan compute
              their rotary positions as they go), and no more than the device's free memory
              fits, by an estimate of the VAE decode, the denoiser's activations and the graph
              pool, times {MEMORY_MARGIN} (for wan, of one frame: the estimate knows no video)
  --steps     1 (2 for qwen-image's scheduler) to {MAX_STEPS}: the scheduler's
              num_train_timesteps (more steps only repeat the noise levels it was trained on)
  --seed      0 to 2**63 - 1; image i uses seed + i, so the last image's seed must fit too
  --guidance  a finite number, 0 or more
  --frames    video models only (wan), 4k+1: its VAE packs 4 frames into each latent after
              the first
  --size full builds z-image's 10B, qwen-image's 29B, flux's 17B (FLUX.1-dev), wan's 20B
              (Wan2.1-T2V-14B) or wan-1.3b's 7B parameters, text encoders included:
              it needs a CUDA GPU with room for their weights; on a CPU it is refused
  prompts     the text encoder reads a limited number of tokens (512 for every built-in model;
              flux's CLIP encoder, whose pooled output it also reads, 77); a longer prompt is
              cut there, with a warning that gives the counts for z-image and qwen-image

videos: a video model (wan) writes one PNG per video, its first frame; the others are generated
  (they shape the first) but not written. The PNG's "frames" text says how many were made.

files: an image that already exists is never replaced unless --overwrite is given (checked
  before the model is built); a file that appears while the run generates (another run writing
  to the same place) is kept, and the new image goes to a free name, with a warning.

step caches (--cache): fbc, diffusers' First Block Cache (--cache-threshold, default 0.05);
  taylorseer, diffusers' TaylorSeer (--cache-interval, default 5); magcache, diffusers' MagCache
  (--cache-ratios, calibrated for the model, required; --cache-threshold, default 0.06);
  dbcache, cache-dit's DBCache (--cache-threshold, its residual_diff_threshold, default 0.08;
  pip install "bcg-diffusers[cache-dit]"). diffusers' caches need a denoiser that supports them
  (qwen-image, flux and wan do; z-image does not in diffusers 0.42; taylorseer finds no
  attention module it knows in wan).

{_compile_cache_line()}
  (--compile-cache DIR, else ${options.COMPILE_CACHE_ENV}, else $XDG_CACHE_HOME or ~/.cache, then
  bcg-diffusers/compile; a TORCHINDUCTOR_CACHE_DIR you set wins over the default).
  Delete that folder to clear the cache.

exit status: 0 done, 1 loading or generating failed, 2 bad input, 130 interrupted (Ctrl-C),
  143 terminated (SIGTERM).
multi-GPU: accelerate launch --num_processes N scripts/generate.py ... splits the work; with
  --parallel every process works on every image together and only rank 0 writes files.
""",
    )
    p.add_argument(
        "--model",
        type=_model,
        default=DEFAULT_MODEL,
        help="'z-image' (default; built offline with random weights), 'qwen-image', 'flux' (FLUX.1-dev), "
        "'wan' (Wan2.1-T2V-14B), 'wan-1.3b', a local pipeline folder or a Hugging Face hub id (org/name)",
    )
    p.add_argument(
        "--size",
        choices=("tiny", "full"),
        default="tiny",
        help="size of the built-in random-weight models (default tiny; full needs a GPU)",
    )
    p.add_argument(
        "--prompt",
        type=_prompt,
        action="append",
        default=[],
        help=f"a prompt (repeat for several; default {DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--negative-prompt", type=check_utf8, default=None, help="negative prompt (used only when guidance is on)"
    )
    p.add_argument(
        "--prompts-file",
        type=_path,
        default=None,
        help="a UTF-8 text file with one prompt a line (blank lines and #-comments skipped)",
    )
    p.add_argument(
        "--resolution",
        type=_resolution,
        nargs="+",
        action="extend",
        default=None,
        metavar="WxH",
        help=f"one or more WIDTHxHEIGHT, multiples of {multiple} (default 512x512; wan: 832x480, "
        "its 480p, at --size full and 256x256 tiny)",
    )
    p.add_argument(
        "--frames",
        type=_positive_int,
        default=None,
        metavar="N",
        help="video models: frames per video, 4k+1 (default for wan 33 at --size full, 5 tiny; another video "
        "pipeline: its own); each video is written as one PNG, its first frame",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help=f"denoising steps, 1 to {MAX_STEPS} (default: 9 for z-image, 20 for qwen-image, 28 for flux, else 30)",
    )
    p.add_argument(
        "--guidance",
        type=_guidance,
        default=None,
        help="Z-Image guidance_scale / Qwen-Image true_cfg_scale / FLUX.1-dev's distilled guidance_scale (no CFG) / "
        "Wan guidance_scale, 0 or more (default 0.0 / 4.0 / 3.5 / 5.0)",
    )
    p.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of the first image, 0 to 2**63 - 1; image i uses seed + i (default 0)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=1, help="images per prompt per pipeline call")
    p.add_argument(
        "--warmup",
        type=_warmup_item,
        nargs="+",
        action="extend",
        default=None,
        metavar="WxH",
        help="resolutions to capture before the first image (default: those generated; 'none' skips)",
    )
    p.add_argument(
        "--mode",
        choices=options.MODES,
        default=None,
        help="bcg: CUDA graphs (default); debug: same runner, denoiser eager; eager: no acceleration",
    )
    p.add_argument(
        "--parallel",
        choices=options.PARALLEL_MODES,
        default=None,
        help="under accelerate launch / torchrun, compute each image on all processes together (cfg: the two "
        "guidance branches on 2 GPUs, exact; ulysses: diffusers' context parallelism; cfg+ulysses: both, 4+ GPUs); "
        "every process runs every job with the same seeds, rank 0 writes the files",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the denoiser's repeated blocks with inductor and capture the graphs over the "
        "compiled kernels (CUDA only; the first run compiles, later runs reuse the cache)",
    )
    p.add_argument(
        "--compile-cache",
        type=_path,
        default=None,
        metavar="DIR",
        help=f"folder of the persistent compile cache (default {options.default_compile_cache_dir()}); "
        "delete it to clear the cache",
    )
    p.add_argument(
        "--no-text-encoder-graphs",
        dest="text_encoder_graphs",
        action="store_false",
        help="run the text encoders eagerly (default: a graph per prompt token length, captured by the warmup)",
    )
    p.add_argument(
        "--no-vae-graphs",
        dest="vae_graphs",
        action="store_false",
        help="run the VAE decoder eagerly (default: a graph per latent shape, in the denoiser's graph pool)",
    )
    p.add_argument(
        "--no-cfg-batch",
        dest="cfg_batch",
        action="store_false",
        help="run true CFG's two denoiser calls one after the other (default: one call at twice the batch "
        "where the text is padded anyway, e.g. Qwen-Image up to 768x768)",
    )
    p.add_argument(
        "--no-auto-breaks",
        dest="auto_breaks",
        action="store_false",
        help="when a capture fails on an operation a graph cannot hold, only name it (default: run the function "
        "that did it as an eager break and capture again, kept only if equal to eager)",
    )
    p.add_argument(
        "--cache",
        choices=CACHES,
        default=None,
        help="skip denoiser work on steps whose result barely changes: fbc (First Block Cache), taylorseer, "
        "magcache (diffusers' hooks) or dbcache (cache-dit, an optional extra); applied before acceleration",
    )
    p.add_argument(
        "--cache-threshold",
        type=_positive,
        default=None,
        metavar="FLOAT",
        help="fbc, magcache, dbcache: how much change a step may skip (higher: faster, less exact; "
        "default each method's own)",
    )
    p.add_argument(
        "--cache-interval",
        type=_positive_int,
        default=None,
        metavar="INT",
        help="taylorseer: compute every INT-th step, predict the others (default 5)",
    )
    p.add_argument(
        "--cache-ratios",
        type=_ratios,
        default=None,
        metavar="R1,R2,...",
        help="magcache (required): the model's calibrated magnitude ratios, one per step (resampled to --steps)",
    )
    p.add_argument(
        "--device", default=None, help="torch device: cpu, cuda, cuda:N (default cuda if available, else cpu)"
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weights dtype (default bfloat16 on cuda, float32 on cpu)"
    )
    p.add_argument(
        "--out",
        type=_out_path,
        default=Path("outputs"),
        help="a .png file for a single image, else a folder (default outputs/)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace images that already exist (default: refuse, before the model is built)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print the accelerator's counters at the end, for the denoiser and each graphed component",
    )
    p.add_argument("--quiet", action="store_true", help="only warnings and errors: no progress bars or info logs")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p
