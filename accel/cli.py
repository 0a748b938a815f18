"""bcg-generate: generate images with a diffusers pipeline whose denoiser replays CUDA graphs.

    bcg-generate --prompt "a red fox in the snow" --out fox.png
    bcg-generate --model qwen-image --resolution 512x512 768x512 --batch-size 2
    accelerate launch --num_processes 2 scripts/generate.py --prompts-file samples/prompts.txt

The work is a list of jobs, one pipeline call each: every (prompt, resolution) pair, in that
order, makes ``--batch-size`` images. Image ``i`` of a run (counted over the whole run) uses seed
``--seed + i`` and is written as ``{i:04d}-{slug}-{W}x{H}-s{seed}.png``, so names and pixels do
not depend on how many processes share the work. Under ``accelerate launch`` each process takes a
contiguous share of the jobs (the split of ``PartialState.split_between_processes``), runs on its
own device and captures its own graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROMPT", "Job", "main", "parse_resolution", "plan_jobs", "shard", "slug"]

logger = logging.getLogger("bcg-generate")

PROG = "bcg-generate"
DEFAULT_PROMPT = "a red fox in the snow, golden hour"
DEFAULT_MODEL = "z-image"
DEFAULT_RESOLUTION = (512, 512)
RESOLUTION_MULTIPLE = 16  # the VAE's factor 8 times the denoiser's patch size 2
MODES = ("bcg", "eager", "debug")
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


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


def plan_jobs(
    prompts: Sequence[str], resolutions: Sequence[tuple[int, int]], batch_size: int, seed: int
) -> list[Job]:
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
# Argument parsing and validation
# --------------------------------------------------------------------------------------------
def parse_resolution(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``; positive multiples of 16."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"resolution {text!r} is not WIDTHxHEIGHT (for example 512x512)")
    width, height = int(m.group(1)), int(m.group(2))
    if width <= 0 or height <= 0 or width % RESOLUTION_MULTIPLE or height % RESOLUTION_MULTIPLE:
        raise argparse.ArgumentTypeError(
            f"resolution {text!r}: width and height must be positive multiples of {RESOLUTION_MULTIPLE}"
        )
    return width, height


def _warmup_item(text: str) -> tuple[int, int] | None:
    if text.strip().lower() == "none":
        return None
    return parse_resolution(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise CLIError(f"{message} (see {PROG} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Generate images with a diffusers pipeline whose denoiser replays breakable CUDA graphs.",
        epilog="Multi-GPU: accelerate launch --num_processes N scripts/generate.py ... splits the work.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="'z-image' (default; built offline with random weights), 'qwen-image', "
                        "a local pipeline folder or a Hugging Face hub id (org/name)")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="size of the built-in random-weight models (default tiny)")
    p.add_argument("--prompt", action="append", default=[],
                   help=f"a prompt (repeat for several; default {DEFAULT_PROMPT!r})")
    p.add_argument("--negative-prompt", default=None, help="negative prompt (used when guidance is on)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a text file with one prompt a line (blank lines and #-comments skipped)")
    p.add_argument("--resolution", type=parse_resolution, nargs="+", action="extend", default=None,
                   metavar="WxH", help="one or more WIDTHxHEIGHT, multiples of 16 (default 512x512)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="denoising steps (default: 9 for z-image, 20 for qwen-image, else 30)")
    p.add_argument("--guidance", type=float, default=None,
                   help="Z-Image guidance_scale / Qwen-Image true_cfg_scale (default 0.0 / 4.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image; image i uses seed + i (default 0)")
    p.add_argument("--batch-size", type=_positive_int, default=1, help="images per prompt per pipeline call")
    p.add_argument("--warmup", type=_warmup_item, nargs="+", default=None, metavar="WxH",
                   help="resolutions to capture before the first image (default: those generated; 'none' skips)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="bcg: CUDA graphs (default); debug: same runner, denoiser eager; eager: no acceleration")
    p.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--out", type=Path, default=Path("outputs"),
                   help="a .png file for a single image, else a folder (default outputs/)")
    p.add_argument("--report", action="store_true", help="print the accelerator's counters at the end")
    p.add_argument("--quiet", action="store_true", help="no log messages or progress bars")
    return p


def read_prompts_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CLIError(f"--prompts-file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read --prompts-file {str(path)!r}: {_one_line(e)}") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise CLIError(f"--prompts-file {str(path)!r} holds no prompts (blank lines and # comments are skipped)")
    return prompts


def resolve_device(text: str | None, mode: str | None) -> Any:
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
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(f"--device {text}: MPS is not available here")
    return device


def check_out(out: Path, n_images: int) -> tuple[Path, Path | None]:
    """The folder to write into (created and checked writable) and the single file, if one."""
    single = out.suffix.lower() == ".png"
    if single and n_images != 1:
        raise CLIError(f"--out {str(out)!r} names one file but this run makes {n_images} images; pass a folder")
    folder = out.parent if single else out
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise CLIError(f"--out {str(out)!r} is not writable: {_one_line(e)}") from None
    return folder, out if single else None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# --------------------------------------------------------------------------------------------
# Model defaults: each recipe knows its model's (accel.recipe.Recipe.generation_defaults)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Preset:
    steps: int
    guidance: float | None  # None: leave the pipeline's own default
    guidance_kwarg: str | None  # "guidance_scale", "true_cfg_scale" or None
    cfg_above: float  # classifier-free guidance runs when guidance > this
    default_negative: str | None  # true CFG needs a negative prompt to run at all


def preset_for(pipe: Any) -> Preset:
    from .pipeline import DENOISER_NAMES
    from .recipe import recipe_for

    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if module is not None:
            defaults = recipe_for(module)().generation_defaults()
            if defaults:
                return Preset(**defaults)
            break
    params = inspect.signature(pipe.__call__).parameters
    if "true_cfg_scale" in params:
        return Preset(30, None, "true_cfg_scale", 1.0, " ")
    if "guidance_scale" in params:
        return Preset(30, None, "guidance_scale", 1.0, None)
    return Preset(30, None, None, 1.0, None)


def build_model(model: str, size: str, device: Any, dtype: Any) -> Any:
    """The pipeline: embedded models from the offline builders, anything else from_pretrained."""
    from pipelines.builders import build_pipeline  # the model registry; accel itself never needs it

    return build_pipeline(model, size=size, device=device, dtype=dtype, seed=0)


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
        from . import __version__

        return __version__


def _setup_logging(quiet: bool, procs: Processes) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format=f"%(asctime)s {procs.tag}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if quiet:
        logging.getLogger().setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-generate``; returns the exit status (0 ok, 2 bad input)."""
    try:
        return _run(build_parser().parse_args(argv))
    except CLIError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


def _run(args: argparse.Namespace) -> int:
    import torch

    # Cheap checks first, before anything is built.
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    prompts = [p for p in prompts if p.strip()] or [DEFAULT_PROMPT]
    resolutions = list(dict.fromkeys(args.resolution or [DEFAULT_RESOLUTION]))
    if args.warmup is not None and None in args.warmup and len(args.warmup) > 1:
        raise CLIError("--warmup takes resolutions or 'none', not both")
    device = resolve_device(args.device, args.mode)
    jobs = plan_jobs(prompts, resolutions, args.batch_size, args.seed)
    n_images = sum(len(j.indices) for j in jobs)
    folder, single = check_out(args.out, n_images)

    procs = detect_processes(cpu=device.type != "cuda")
    _setup_logging(args.quiet, procs)
    if procs.count > 1 and procs.device is not None and device.type != "cpu" and procs.device.type == device.type:
        device = procs.device  # each process on its own GPU
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graphs are captured on the current device
    mine = shard(jobs, procs.index, procs.count)
    if procs.count > 1:
        logger.info("%d of %d jobs on %s", len(mine), len(jobs), device)

    mode = args.mode or "bcg"
    dtype = getattr(torch, DTYPES[args.dtype] if args.dtype else ("bfloat16" if device.type == "cuda" else "float32"))
    try:
        pipe = build_model(args.model, args.size, device, dtype)
    except ValueError as e:
        raise CLIError(_one_line(e)) from None
    except (OSError, ImportError) as e:
        raise CLIError(f"could not load model {args.model!r}: {_one_line(e)}") from None
    pipe.set_progress_bar_config(disable=True)

    preset = preset_for(pipe)
    steps = args.steps or preset.steps
    guidance = args.guidance if args.guidance is not None else preset.guidance
    cfg = guidance is not None and guidance > preset.cfg_above
    negative = args.negative_prompt
    if negative is None and cfg and preset.default_negative is not None:
        negative = preset.default_negative
    if guidance is not None and preset.guidance_kwarg is None:
        logger.warning("%s takes no guidance scale; --guidance %s is ignored", type(pipe).__name__, guidance)

    warmup_seconds = 0.0
    if mode != "eager":
        from .pipeline import accelerate_pipeline

        accelerate_pipeline(pipe, mode=mode)
    if device.type != "cuda":
        if mode != "eager":
            logger.info("CUDA graphs need CUDA: this run on %s is eager (mode %s captures nothing)", device, mode)
    elif mode != "eager" and mine and args.warmup != [None]:
        warm = args.warmup or list(dict.fromkeys((j.width, j.height) for j in mine))
        warmup_seconds = _warmup(pipe, warm, mine, negative, cfg, args.batch_size, not args.quiet)

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
    if single is None and not args.quiet:
        logger.info("writing %d image(s) to %s", sum(len(j.indices) for j in mine), folder)

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

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
            if negative is not None:
                kwargs["negative_prompt"] = negative
            if guidance is not None and preset.guidance_kwarg is not None:
                kwargs[preset.guidance_kwarg] = guidance
            t0 = time.perf_counter()
            images = pipe(**kwargs).images
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            gen_seconds += time.perf_counter() - t0
            for image, index, seed, name in zip(images, job.indices, job.seeds, job.filenames):
                path = single if single is not None else folder / name
                info = dict(prompt=job.prompt, seed=str(seed), resolution=f"{job.width}x{job.height}",
                            index=str(index), **meta_common)  # fmt: skip
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
    logger.debug("summary: %s", summary)
    print(summary)
    if args.report:
        print(pipe.accel.report() if mode != "eager" else f"{procs.tag}mode eager: the pipeline was not accelerated")
    if procs.state is not None:
        # No barrier: processes share nothing but the folder, and a barrier would need a
        # working collective backend for no benefit.
        procs.state.destroy_process_group()
    return 0


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


def _save_png(image: Any, path: Path, info: dict[str, str]) -> None:
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in info.items():
        meta.add_text(key, value)
    image.save(path, format="PNG", pnginfo=meta)


if __name__ == "__main__":
    raise SystemExit(main())
