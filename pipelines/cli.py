"""bcg-generate: generate images with a diffusers pipeline whose denoiser replays CUDA graphs.

    bcg-generate --prompt "a red fox in the snow" --out outputs/fox.png
    bcg-generate --model qwen-image --resolution 512x512 768x512 --batch-size 2
    accelerate launch --num_processes 2 scripts/generate.py --prompts-file samples/prompts.txt

The work is a list of jobs, one pipeline call each: every (prompt, resolution) pair, in that
order, makes ``--batch-size`` images. Image ``i`` of a run (counted over the whole run) uses seed
``--seed + i`` and is written as ``{i:04d}-{slug}-{W}x{H}-s{seed}.png``, so names and pixels do
not depend on how many processes share the work. Under ``accelerate launch`` each process takes a
contiguous share of the jobs (the split of ``PartialState.split_between_processes``), runs on its
own device and captures its own graphs.

The CLI lives in ``pipelines`` (the layer that knows models), not in ``accel``: it builds models
through :mod:`pipelines.builders`, and ``accel`` never imports ``pipelines``.

Bad input is one line on stderr and exit status 2 (a request beyond a limit of
:mod:`pipelines.limits` included); a failure while loading or generating is one line and status 1;
Ctrl-C is status 130. Nothing is written before the checks pass, and an image file appears only
once it is complete (written to a hidden ``.part`` file, then renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from accel.options import (
    MODES,
    PARALLEL_MODES,
    RESOLUTION_MULTIPLE,
    GenerationDefaults,
    default_compile_cache_dir,
    parse_resolution,
)

from . import limits

__all__ = [
    "DEFAULT_PROMPT",
    "CLIError",
    "Job",
    "RunError",
    "build_parser",
    "generation_defaults",
    "main",
    "plan_jobs",
    "shard",
    "slug",
]

logger = logging.getLogger("bcg-generate")

PROG = "bcg-generate"
DEFAULT_PROMPT = "a red fox in the snow, golden hour"
DEFAULT_MODEL = "z-image"
DEFAULT_RESOLUTION = (512, 512)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip
# Bytes per pixel of one decoded image on the host: the pipeline's float32 RGB array plus the
# 8-bit copy a PNG is made from. A floor no model can go below, checked before anything is built.
HOST_BYTES_PER_PIXEL = 3 * 4 + 3
# Suffixes Pillow does not register but users type for images: --out with one is a mistake.
_MORE_IMAGE_SUFFIXES = (".avif", ".heic", ".heif", ".jxl", ".jpe", ".jfif")

T = TypeVar("T")


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""

    status = 2


class RunError(CLIError):
    """A failure while loading or generating: one line on stderr, exit status 1."""

    status = 1


# --------------------------------------------------------------------------------------------
# Jobs: what to generate, and which process generates it
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Job:
    """One pipeline call: ``len(indices)`` images of one prompt at one resolution.

    ``indices`` are global image indices of the run and ``seeds[k] == seed + indices[k]``.
    """

    prompt: str
    width: int
    height: int
    indices: tuple[int, ...]
    seeds: tuple[int, ...]

    @property
    def filenames(self) -> list[str]:
        return [image_filename(i, self.prompt, self.width, self.height, s) for i, s in zip(self.indices, self.seeds)]


def plan_jobs(prompts: Sequence[str], resolutions: Sequence[tuple[int, int]], batch_size: int, seed: int) -> list[Job]:
    """Every (prompt, resolution) pair, prompt-major, ``batch_size`` images each."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    jobs: list[Job] = []
    index = 0
    for prompt in prompts:
        for width, height in resolutions:
            indices = tuple(range(index, index + batch_size))
            jobs.append(Job(prompt, width, height, indices, tuple(seed + i for i in indices)))
            index += batch_size
    return jobs


def shard(jobs: Sequence[Job], process_index: int, num_processes: int) -> list[Job]:
    """This process's contiguous share of ``jobs``.

    The same split as accelerate's ``PartialState.split_between_processes`` (without padding):
    the first ``len(jobs) % num_processes`` processes take one job more.
    """
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process {process_index} of {num_processes} does not exist")
    per, extra = divmod(len(jobs), num_processes)
    start = process_index * per + min(process_index, extra)
    end = start + per + (1 if process_index < extra else 0)
    return list(jobs[start:end])


def slug(text: str) -> str:
    """Lower-case ASCII words joined by '-': safe in a file name on any system."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s or "image"


def image_filename(index: int, prompt: str, width: int, height: int, seed: int) -> str:
    return f"{index:04d}-{slug(prompt)[:40].rstrip('-')}-{width}x{height}-s{seed}.png"


# --------------------------------------------------------------------------------------------
# Argument parsing: each value checked as it is read
# --------------------------------------------------------------------------------------------
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
    p.add_argument("--report", action="store_true", help="print the accelerator's counters at the end")
    p.add_argument("--quiet", action="store_true", help="only warnings and errors: no progress bars or info logs")
    return p


# --------------------------------------------------------------------------------------------
# Checks that need no model
# --------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a file: one a line, blank lines and ``#`` comments skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not part of a prompt
    except FileNotFoundError:
        raise CLIError(f"--prompts-file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise CLIError(f"--prompts-file {str(path)!r} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompts-file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CLIError(f"cannot read --prompts-file {str(path)!r}: {e.strerror or _one_line(e)}") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise CLIError(f"--prompts-file {str(path)!r} holds no prompts (blank lines and # comments are skipped)")
    return prompts


def resolve_device(text: str | None, mode: str | None) -> Any:
    """The torch device to run on; CLIError for one that does not exist here."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise CLIError(f"--device {text!r} is not a device torch knows (for example cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = f"--mode {mode} needs CUDA" if mode in ("bcg", "debug") else f"--device {text}"
            raise CLIError(f"{why}, but no CUDA device is available here; pass --device cpu to run eagerly")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "meta":
        raise CLIError("--device meta holds shapes but no data, so it cannot make images; use cpu or cuda")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
        available = getattr(backend, "is_available", None)
        if not callable(available) or not available():
            raise CLIError(f"--device {text}: {device.type} is not available here (use cpu or cuda)")
    return device


def _image_suffixes() -> set[str]:
    from PIL import Image

    return {s.lower() for s in Image.registered_extensions()} | set(_MORE_IMAGE_SUFFIXES)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_out(out: Path, n_images: int) -> tuple[Path, Path | None]:
    """The folder to write into and the single file, if one; nothing is created here.

    The folder is made only when the first image is written, so a run refused later leaves no
    empty folder behind.
    """
    suffix = out.suffix.lower()
    single = suffix == ".png" and not out.is_dir()
    if not single and suffix in _image_suffixes() and not out.is_dir():
        raise CLIError(f"--out {str(out)!r}: only PNG is written; use {str(out.with_suffix('.png'))!r} (or a folder)")
    if single and n_images != 1:
        raise CLIError(f"--out {str(out)!r} names one file but this run makes {n_images} images; pass a folder")
    folder = out.parent if single else out
    if folder.exists() and not folder.is_dir():
        raise CLIError(f"--out {str(folder)!r} is an existing file, not a folder")
    ancestor = _nearest_existing(folder)
    if not ancestor.is_dir():
        raise CLIError(f"--out {str(out)!r} is not writable: {str(ancestor)!r} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"--out {str(out)!r} is not writable: no permission to write in {str(ancestor)!r}")
    return folder, out if single else None


def _check_compile_cache(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CLIError(f"--compile-cache {str(path)!r} is an existing file, not a folder")
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"--compile-cache {str(path)!r} cannot be created: {str(ancestor)!r} is not a writable folder")


# --------------------------------------------------------------------------------------------
# Model defaults: each recipe knows its model's (accel.recipe.Recipe.generation_defaults)
# --------------------------------------------------------------------------------------------
def generation_defaults(pipe: Any) -> GenerationDefaults:
    """How ``pipe`` is usually run: its recipe's defaults, else what its signature allows."""
    from accel.pipeline import DENOISER_NAMES
    from accel.recipe import recipe_for

    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if module is not None:
            defaults = recipe_for(module)().generation_defaults()
            if defaults is not None:
                return defaults
            break
    # No recipe default: leave the pipeline's own guidance alone, but know its argument's name.
    params = inspect.signature(pipe.__call__).parameters
    if "true_cfg_scale" in params:
        return GenerationDefaults(guidance_kwarg="true_cfg_scale", default_negative=" ")
    if "guidance_scale" in params:
        return GenerationDefaults(guidance_kwarg="guidance_scale")
    return GenerationDefaults()


# --------------------------------------------------------------------------------------------
# Loading a model: library warnings held back, errors in one line
# --------------------------------------------------------------------------------------------
_LIBRARY_LOGGERS = ("diffusers", "transformers", "huggingface_hub")


def _load_quietly(load: Callable[[], T]) -> T:
    """Run ``load`` with the libraries' warnings held back; they are shown only if it succeeds.

    A failed hub load first warns "Couldn't connect to the Hub ... Will try to load from local
    cache", then raises: the warnings only repeat the error, which is reported in one line.
    """
    records: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    hold = Hold(logging.WARNING)
    saved = []
    for name in _LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers, lg.propagate = [hold], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            result = load()
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
    for record in records:
        logging.getLogger(record.name).handle(record)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


def _load_error_message(model: str, error: BaseException) -> str:
    """What went wrong loading ``model``, in one line: the cause, not diffusers' whole story."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names: set[str] = set()
    for x in chain:
        names.update(k.__name__ for k in type(x).__mro__)
    head = f"could not load model {model!r}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if "GatedRepoError" in names:
        return f"{head}: the repository is gated; accept its terms on the hub and log in (hf auth login)"
    if "RepositoryNotFoundError" in names:
        return f"{head}: no such model on the hub (check the name; a private one needs hf auth login)"
    if "OfflineModeIsEnabled" in names or (offline and "LocalEntryNotFoundError" in names):
        return f"{head}: not found in the local cache, and HF_HUB_OFFLINE is set (unset it to download)"
    network = {"ConnectError", "ConnectionError", "NetworkError", "TimeoutException", "ConnectTimeout"}
    if names & network or "not fully cached locally" in str(error):
        return f"{head}: not found in the local cache, and the hub is unreachable (no network?)"
    if os.path.isdir(model):
        return f"{head}: the folder is not a diffusers pipeline ({_one_line(error)[:200]})"
    return f"{head}: {_one_line(error)[:300]}"


def build_model(model: str, size: str, device: Any, dtype: Any) -> Any:
    """The pipeline: embedded models from the offline builders, anything else from_pretrained."""
    from .builders import build_pipeline

    try:
        return _load_quietly(lambda: build_pipeline(model, size=size, device=device, dtype=dtype, seed=0))
    except ValueError as e:
        if "unknown model" in str(e) or "unknown size" in str(e):
            raise CLIError(_one_line(e)) from None
        raise RunError(_load_error_message(model, e)) from None
    except Exception as e:  # from_pretrained raises many kinds; each ends as one line
        raise RunError(_load_error_message(model, e)) from None


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Processes:
    index: int = 0
    count: int = 1
    device: Any = None  # this process's device under accelerate
    state: Any = None

    @property
    def tag(self) -> str:
        return f"[rank {self.index}/{self.count}] " if self.count > 1 else ""


def detect_processes(cpu: bool) -> Processes:
    """accelerate's PartialState when launched with several processes, else a single process.

    ``cpu``: the processes run on the CPU (gloo) rather than one GPU each. accelerate only
    starts several CPU processes through torchrun (``accelerate launch --multi_gpu`` on a
    machine without GPUs) or mpirun; ``--cpu`` alone starts one.
    """
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        world, rank = 1, 0
    if world <= 1:
        return Processes()
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    if state.num_processes != world:  # never split wrongly: the launcher's numbers decide
        logger.warning("accelerate sees %d process(es), the launcher started %d", state.num_processes, world)
        return Processes(rank, world, None, None)
    return Processes(state.process_index, state.num_processes, state.device, state)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def _version() -> str:
    try:
        from importlib.metadata import version

        return version("bcg-diffusers")
    except Exception:
        from accel import __version__

        return __version__


def _setup_logging(quiet: bool, procs: Processes) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format=f"%(asctime)s {procs.tag}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger().setLevel(logging.WARNING if quiet else logging.INFO)
    if quiet:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-generate``; returns the exit status (0 ok, 1 failed, 2 bad input, 130 interrupted)."""
    try:
        return _run(build_parser().parse_args(argv))
    except CLIError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return e.status
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


def _largest(sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    return sorted(set(sizes), key=lambda wh: (wh[0] * wh[1], wh), reverse=True)


def _run(args: argparse.Namespace) -> int:
    import torch

    # Cheap checks first, before anything is built or written.
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    prompts = prompts or [DEFAULT_PROMPT]
    resolutions = list(dict.fromkeys(args.resolution or [DEFAULT_RESOLUTION]))
    warmup_sizes: list[tuple[int, int]] | None = None
    if args.warmup is not None:
        if None in args.warmup and any(w is not None for w in args.warmup):
            raise CLIError("--warmup takes resolutions or 'none', not both")
        warmup_sizes = list(dict.fromkeys(w for w in args.warmup if w is not None))
    mode = args.mode or "bcg"
    if args.compile and mode == "eager":
        raise CLIError("--compile prepares graph capture, which --mode eager never does: drop one of them")
    if args.compile_cache is not None:
        _check_compile_cache(args.compile_cache)
        if not args.compile:
            raise CLIError("--compile-cache is the folder of --compile's kernel cache: add --compile")
    device = resolve_device(args.device, args.mode)
    dtype = getattr(torch, DTYPES[args.dtype] if args.dtype else ("bfloat16" if device.type == "cuda" else "float32"))
    n_images = len(prompts) * len(resolutions) * args.batch_size
    try:
        limits.check_seeds(args.seed, n_images)
    except limits.LimitError as e:
        raise CLIError(str(e)) from None
    _check_embedded(args.model, args.size, device, dtype, resolutions, warmup_sizes or [])
    _check_host_floor(_largest([*resolutions, *(warmup_sizes or [])])[0], args.batch_size)
    folder, single = check_out(args.out, n_images)

    procs = detect_processes(cpu=device.type != "cuda")
    _setup_logging(args.quiet, procs)
    if procs.count > 1 and procs.device is not None and device.type != "cpu" and procs.device.type == device.type:
        device = procs.device  # each process on its own GPU
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graphs are captured on the current device
    jobs = plan_jobs(prompts, resolutions, args.batch_size, args.seed)
    if args.parallel is not None and procs.count < 2:
        raise CLIError(
            f"--parallel {args.parallel} computes each image on several processes: start this with accelerate launch "
            "--num_processes 2 (or torchrun --nproc_per_node 2)"
        )
    # --parallel: every process takes part in every job (same seeds); rank 0 writes the files.
    mine = list(jobs) if args.parallel is not None else shard(jobs, procs.index, procs.count)
    writes = args.parallel is None or procs.index == 0
    if procs.count > 1:
        logger.info("%d of %d jobs on %s", len(mine), len(jobs), device)

    pipe = build_model(args.model, args.size, device, dtype)
    pipe.set_progress_bar_config(disable=True)

    defaults = generation_defaults(pipe)
    steps = args.steps or defaults.steps
    guidance = args.guidance if args.guidance is not None else defaults.guidance
    cfg = guidance is not None and guidance > defaults.cfg_above
    negative = args.negative_prompt
    if negative is not None and guidance is not None and not cfg:
        logger.warning("--negative-prompt is ignored: classifier-free guidance runs only with --guidance above %g "
                       "(this run uses %g)", defaults.cfg_above, guidance)  # fmt: skip
        negative = None
    if negative is None and cfg and defaults.default_negative is not None:
        negative = defaults.default_negative
    if args.guidance is not None and defaults.guidance_kwarg is None:
        logger.warning("%s takes no guidance scale; --guidance %s is ignored", type(pipe).__name__, args.guidance)

    # Limits that need the built model, still before anything runs or is written.
    warm: list[tuple[int, int]] = []
    graphs = device.type == "cuda" and mode == "bcg"
    if device.type == "cuda" and mode != "eager" and mine and warmup_sizes != []:
        warm = warmup_sizes or list(dict.fromkeys((j.width, j.height) for j in mine))
    try:
        limits.check_steps(steps, getattr(getattr(pipe, "scheduler", None), "config", None))
        limit = limits.pipeline_position_limit(pipe)
        limits.check_positions(limit, resolutions, "--resolution")
        limits.check_positions(limit, warm, "--warmup")
        # Unknown guidance (the pipeline's own default) may run CFG: plan memory as if it does.
        cfg_memory = cfg or guidance is None
        limits.check_memory(pipe, device, _largest([*resolutions, *warm]), args.batch_size, cfg_memory, graphs)
    except limits.LimitError as e:
        raise CLIError(str(e)) from None

    warmup_seconds = 0.0
    if mode != "eager" or args.parallel is not None:
        from accel.pipeline import accelerate_pipeline

        options: dict[str, Any] = {}
        if args.parallel is not None:
            options["parallel"] = args.parallel
        if args.compile:  # only when asked: the CLI keeps working with an accel without compile
            options["compile"] = True
            if args.compile_cache is not None:
                options["compile_cache_dir"] = args.compile_cache
        try:
            accelerate_pipeline(pipe, mode=mode, **options)
        except (TypeError, ValueError) as e:  # e.g. a hub pipeline with no denoiser to accelerate
            hint = "drop --parallel to split the jobs instead" if args.parallel else "--mode eager runs it as is"
            raise RunError(f"cannot accelerate {type(pipe).__name__}: {_one_line(e)} ({hint})") from None
        if warm:
            try:
                warmup_seconds = _warmup(pipe, warm, mine, negative, cfg, args.batch_size, not args.quiet)
            except torch.OutOfMemoryError:
                sizes = " ".join(f"{w}x{h}" for w, h in warm)
                raise RunError(
                    f"out of memory capturing graphs for {sizes}: use smaller sizes or --warmup none"
                ) from None

    software = f"bcg-diffusers {_version()}"
    meta_common = dict(
        negative_prompt=negative or "",
        steps=str(steps),
        guidance="default" if guidance is None else f"{guidance:g}",
        mode=mode,
        model=args.model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        Software=software,
    )
    if single is None and writes:
        logger.info("writing %d image(s) to %s", sum(len(j.indices) for j in mine), folder)

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    takes_output_type = "output_type" in inspect.signature(pipe.__call__).parameters
    written: list[Path] = []
    gen_seconds = 0.0
    bar = tqdm(total=sum(len(j.indices) for j in mine), unit="image", desc=f"{procs.tag}generating".strip(),
               disable=args.quiet, position=procs.index if procs.count > 1 else None)  # fmt: skip
    with logging_redirect_tqdm(), bar:
        for job in mine:
            kwargs: dict[str, Any] = dict(
                prompt=job.prompt,
                height=job.height,
                width=job.width,
                num_inference_steps=steps,
                num_images_per_prompt=len(job.indices),
                generator=[torch.Generator(device).manual_seed(s) for s in job.seeds],
            )
            if takes_output_type:
                kwargs["output_type"] = "np"  # floats, so NaN pixels can be told from black ones
            if negative is not None:
                kwargs["negative_prompt"] = negative
            if guidance is not None and defaults.guidance_kwarg is not None:
                kwargs[defaults.guidance_kwarg] = guidance
            t0 = time.perf_counter()
            images = _generate(pipe, kwargs, job, _nan_hint(args))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            gen_seconds += time.perf_counter() - t0
            for image, index, seed, name in zip(images, job.indices, job.seeds, job.filenames):
                path = single if single is not None else folder / name
                info = dict(prompt=job.prompt, seed=str(seed), resolution=f"{job.width}x{job.height}",
                            index=str(index), **meta_common)  # fmt: skip
                if writes:
                    _save_png(image, path, info)
                written.append(path)
                bar.update()

    n = len(written)
    graph_mib = pipe.accel.graph_memory_bytes() / 2**20 if mode != "eager" else 0.0
    summary = (
        f"{procs.tag}{n} image(s) in {gen_seconds:.2f} s: warmup {warmup_seconds:.2f} s, "
        f"{gen_seconds / n if n else 0.0:.3f} s/image, "
        f"{len(mine) * steps / gen_seconds if gen_seconds else 0.0:.1f} denoising steps/s, "
        f"graph memory {graph_mib:.1f} MiB ({type(pipe).__name__}, mode {mode}, {device})"
    )
    print(summary)
    if args.report:
        print(pipe.accel.report() if mode != "eager" else f"{procs.tag}mode eager: the pipeline was not accelerated")
    if procs.state is not None:
        # No barrier: processes share nothing but the folder, and a barrier would need a
        # working collective backend for no benefit.
        procs.state.destroy_process_group()
    return 0


def _check_host_floor(largest: tuple[int, int], batch_size: int) -> None:
    """Refuse a call whose decoded images alone exceed the host's free memory (any model)."""
    free = limits.host_available_memory()
    width, height = largest
    need = batch_size * width * height * HOST_BYTES_PER_PIXEL
    if free is not None and need > free:
        raise CLIError(
            f"--resolution {width}x{height} with --batch-size {batch_size}: the decoded images of one call alone take "
            f"{limits.format_bytes(need)} of host memory ({HOST_BYTES_PER_PIXEL} bytes a pixel) but "
            f"{limits.format_bytes(free)} is free"
        )


def _looks_like_path(model: str) -> bool:
    # A hub id is exactly "org/name"; anything else with a separator, or starting like a path, is one.
    return model.startswith((".", "~", "/")) or model.count("/") > 1 or "\\" in model


def _check_embedded(model: str, size: str, device: Any, dtype: Any, resolutions: Sequence[tuple[int, int]],
                    warmup: Sequence[tuple[int, int]]) -> None:  # fmt: skip
    """Limits of the built-in models that their configs tell, before building anything."""
    from .builders import SIZES, canonical_name

    name = canonical_name(model)
    if name is None:
        if _looks_like_path(model) and not os.path.isdir(model):
            raise CLIError(f"--model {model!r}: no such folder")
        return
    if size not in SIZES:
        return
    try:
        limit = limits.embedded_position_limit(name, size)
        limits.check_positions(limit, resolutions, "--resolution")
        limits.check_positions(limit, warmup, "--warmup")
    except limits.LimitError as e:
        raise CLIError(str(e)) from None
    if size == "full":
        # Full size exists to time real kernel sizes on a GPU; on a CPU even weights that fit
        # would take hours a step, so it is refused there whatever the memory.
        need = limits.embedded_weight_bytes(name, size, dtype)
        weights = f"{name}'s weights take {limits.format_bytes(need)} in {str(dtype).removeprefix('torch.')}"
        if device.type != "cuda":
            raise CLIError(f"--size full needs a CUDA GPU ({weights}; this run is on {device}); "
                           "--size tiny runs anywhere")  # fmt: skip
        free = limits.available_memory(device)
        if free is not None and need > free:
            raise CLIError(f"--size full: {weights} but {device} has {limits.format_bytes(free)} free")


def _nan_hint(args: argparse.Namespace) -> str:
    if args.dtype in ("float16", "fp16"):
        return " (float16 overflows in this model: use bfloat16)"
    if args.guidance is not None:
        return f" (--guidance {args.guidance:g} may be too large for this model)"
    return ""


def _generate(pipe: Any, kwargs: dict[str, Any], job: Job, hint: str) -> list[Any]:
    """One pipeline call -> PIL images; RunError for out-of-memory or non-finite pixels."""
    import numpy as np
    import torch

    from accel.parallel import ParallelError

    try:
        images = pipe(**kwargs).images
    except ParallelError as e:  # --parallel: the ranks disagree or lost one another
        raise RunError(_one_line(e)) from None
    except (TypeError, ValueError) as e:  # a pipeline that needs more than a prompt (an input image...)
        raise RunError(f"{type(pipe).__name__} refused the call: {_one_line(e)[:300]}") from None
    except torch.OutOfMemoryError:
        raise RunError(
            f"out of memory generating {len(job.indices)} image(s) at {job.width}x{job.height}: "
            "use a smaller --resolution or --batch-size"
        ) from None
    if kwargs.get("output_type") != "np":
        return list(images)
    array = np.asarray(images)
    if not np.isfinite(array).all():
        raise RunError(
            f"the pipeline produced NaN or infinite pixels for {job.width}x{job.height} seed {job.seeds[0]}"
            f"{hint}; nothing was written for this call"
        )
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(array)


@contextlib.contextmanager
def _removed_on_failure(path: Path) -> Iterator[Path]:
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _save_png(image: Any, path: Path, info: dict[str, str]) -> None:
    """Write ``image`` with ``info`` as PNG text chunks; the file appears only once complete."""
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in info.items():
        meta.add_text(key, value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _removed_on_failure(path.with_name(f".{path.name}.part")) as part:
            image.save(part, format="PNG", pnginfo=meta)
            os.replace(part, path)
    except OSError as e:
        raise RunError(f"cannot write {str(path)!r}: {e.strerror or _one_line(e)}") from None


def _warmup(pipe: Any, resolutions: list[tuple[int, int]], jobs: list[Job], negative: str | None, cfg: bool,
            batch_size: int, progress: bool) -> float:  # fmt: skip
    prompts = list(dict.fromkeys(j.prompt for j in jobs))
    kwargs = dict(negative_prompt=negative, cfg=cfg, batch_sizes=(batch_size,), progress=progress)
    t0 = time.perf_counter()
    try:
        pipe.accel.warmup(resolutions, prompts=prompts, **kwargs)
    except NotImplementedError as e:  # a recipe that cannot measure prompts: its default lengths
        logger.info("warmup: %s; capturing the recipe's default text lengths", e)
        pipe.accel.warmup(resolutions, **kwargs)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
