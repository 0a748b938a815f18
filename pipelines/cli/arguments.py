"""Argument parsing: each value checked as it is read."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from accel.options import MODES, PARALLEL_MODES, RESOLUTION_MULTIPLE, default_compile_cache_dir, parse_resolution

from .. import limits
from .errors import CLIError

PROG = "bcg-generate"
DEFAULT_PROMPT = "a red fox in the snow, golden hour"
DEFAULT_MODEL = "z-image"
DEFAULT_RESOLUTION = (512, 512)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip


def _resolution(text: str) -> tuple[int, int]:
    try:
        return parse_resolution(text)
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
    try:
        limits.check_steps(value)
    except limits.LimitError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--steps {value}: ")) from None
    return value


def _seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= limits.MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{value} is outside 0 to 2**63 - 1 ({limits.MAX_SEED}); image i of a run uses seed + i"
        )
    return value


def _guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the guidance scale must be a finite number, 0 or more")
    return value


def _out_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder, or a .png file for a single image")
    return Path(text)


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt cannot be empty (leave --prompt out for the default prompt)")
    return text


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


def build_parser() -> argparse.ArgumentParser:
    """The ``bcg-generate`` argument parser."""
    cache = default_compile_cache_dir()
    p = _Parser(
        prog=PROG,
        description="Generate images with a diffusers pipeline whose denoiser replays breakable CUDA graphs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
limits (checked before the model runs or anything is written; see pipelines/limits.py):
  resolution  multiples of {RESOLUTION_MULTIPLE}, at most what the model's position table can place
              (z-image: 8192x8192, from its RoPE axes_lens [1024, 512, 512] at 16 pixels a token;
              qwen-image: 98320 a side, from its 4096-row RoPE table), and no more than the
              device's free memory fits, by an estimate of the VAE decode, the denoiser's
              activations and the graph pool, times {limits.MEMORY_MARGIN}
  --steps     1 (2 for qwen-image's scheduler) to {limits.DEFAULT_MAX_STEPS}: the scheduler's
              num_train_timesteps (more steps only repeat the noise levels it was trained on)
  --seed      0 to 2**63 - 1; image i uses seed + i, so the last image's seed must fit too
  --guidance  a finite number, 0 or more
  --size full builds z-image's 10B or qwen-image's 29B parameters: it needs a CUDA GPU with
              room for their weights; on a CPU it is refused

compile cache: --compile keeps compiled kernels in {cache}
  (--compile-cache DIR, else $BCG_COMPILE_CACHE, else $XDG_CACHE_HOME or ~/.cache, then
  bcg-diffusers/compile; a TORCHINDUCTOR_CACHE_DIR you set wins over the default).
  Delete that folder to clear the cache.

exit status: 0 done, 1 loading or generating failed, 2 bad input, 130 interrupted.
multi-GPU: accelerate launch --num_processes N scripts/generate.py ... splits the work; with
  --parallel every process works on every image together and only rank 0 writes files.
""",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'z-image' (default; built offline with random weights), 'qwen-image', "
        "a local pipeline folder or a Hugging Face hub id (org/name)",
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
    p.add_argument("--negative-prompt", default=None, help="negative prompt (used only when guidance is on)")
    p.add_argument(
        "--prompts-file",
        type=Path,
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
        help=f"one or more WIDTHxHEIGHT, multiples of {RESOLUTION_MULTIPLE} (default 512x512)",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help=f"denoising steps, 1 to {limits.DEFAULT_MAX_STEPS} (default: 9 for z-image, 20 for qwen-image, else 30)",
    )
    p.add_argument(
        "--guidance",
        type=_guidance,
        default=None,
        help="Z-Image guidance_scale / Qwen-Image true_cfg_scale, 0 or more (default 0.0 / 4.0)",
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
        choices=MODES,
        default=None,
        help="bcg: CUDA graphs (default); debug: same runner, denoiser eager; eager: no acceleration",
    )
    p.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
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
        type=Path,
        default=None,
        metavar="DIR",
        help=f"folder of the persistent compile cache (default {cache}); delete it to clear the cache",
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
        "--auto-breaks",
        action="store_true",
        help="when a capture fails on an operation a graph cannot hold, run the function that did it eagerly "
        "and capture again (the graph is kept only if it equals eager)",
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
        "--report",
        action="store_true",
        help="print the accelerator's counters at the end, for the denoiser and each graphed component",
    )
    p.add_argument("--quiet", action="store_true", help="only warnings and errors: no progress bars or info logs")
    return p
