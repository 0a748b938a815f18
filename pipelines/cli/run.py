"""main: parse, check, build, warm up, generate and write, report.

Only the standard library is imported here at first: torch, diffusers and accel are imported
inside :func:`main`, so ``--help`` and bad arguments answer at once, and a Ctrl-C or SIGTERM
while they load is reported in one line like any later one.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .arguments import DEFAULT_PROMPT, DTYPES, PROG, accel_options, build_parser, package_version
from .caches import CacheRequest, apply_cache, cache_request, check_supported, denoiser_of
from .checks import (
    _check_embedded,
    _check_host_floor,
    check_compile_cache,
    check_existing,
    check_frames,
    check_out,
    check_positions,
    read_prompts_file,
    resolve_device,
)
from .defaults import default_frames, default_resolution, generation_defaults
from .errors import CLIError, RunError, _one_line
from .images import _generate, save_png
from .jobs import Job, plan_jobs, shard
from .loading import build_model
from .processes import Processes, detect_processes
from .prompts import TruncationWarnings

logger = logging.getLogger("bcg-generate")

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C
TERMINATED = 143  # 128 + SIGTERM
BROKEN_PIPE = 141  # 128 + SIGPIPE, what a tool killed by a closed pipe reports


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt, so the same cleanup runs
    (no half-written file is left) and the run ends with one line instead of silently."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while this is open; the previous handler is restored."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be put back; the default is closest.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
    """Run ``bcg-generate``; returns the exit status (0 ok, 1 failed, 2 bad input, 130 interrupted,
    141 stdout closed, 143 terminated)."""
    with _sigterm_raises():
        try:
            return _run(build_parser().parse_args(argv))
        except CLIError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            return e.status
        except SystemExit as e:  # --help, --version
            return e.code if isinstance(e.code, int) else 0
        except KeyboardInterrupt:
            sys.stderr.write(f"{PROG}: interrupted\n")
            return INTERRUPTED
        except Terminated:
            sys.stderr.write(f"{PROG}: terminated\n")
            return TERMINATED
        except BrokenPipeError:  # stdout's reader left (| head): the images are written; end quietly
            with contextlib.suppress(OSError):  # as Python's docs advise, so the exit flush cannot fail again
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            return BROKEN_PIPE


def _shown(path: Path) -> str:
    """``path`` as text stdout can always print: a name that is not UTF-8 keeps its escapes."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def _largest(sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    return sorted(set(sizes), key=lambda wh: (wh[0] * wh[1], wh), reverse=True)


def _run(args: argparse.Namespace) -> int:
    # Cheap checks first, before anything is built or written, and those that need no torch
    # before it is imported.
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    prompts = prompts or [DEFAULT_PROMPT]
    warmup_sizes: list[tuple[int, int]] | None = None
    if args.warmup is not None:
        if None in args.warmup and any(w is not None for w in args.warmup):
            raise CLIError("--warmup takes resolutions or 'none', not both")
        warmup_sizes = list(dict.fromkeys(w for w in args.warmup if w is not None))
    mode = args.mode or "bcg"
    if args.compile and mode == "eager":
        raise CLIError("--compile prepares graph capture, which --mode eager never does: drop one of them")
    cache = cache_request(args.cache, args.cache_threshold, args.cache_interval, args.cache_ratios)
    if args.compile_cache is not None:
        check_compile_cache(args.compile_cache)
        if not args.compile:
            raise CLIError("--compile-cache is the folder of --compile's kernel cache: add --compile")
    elif args.compile:
        options = accel_options()
        if os.environ.get(options.COMPILE_CACHE_ENV):  # the default folder is checked where it comes from a user
            check_compile_cache(options.default_compile_cache_dir(), f"${options.COMPILE_CACHE_ENV}")
    import torch

    from .. import limits

    # After the import: a built-in model's own default size is known from the builders.
    resolutions = list(dict.fromkeys(args.resolution or [default_resolution(args.model, args.size)]))
    device = resolve_device(args.device, args.mode)
    dtype = getattr(torch, DTYPES[args.dtype] if args.dtype else ("bfloat16" if device.type == "cuda" else "float32"))
    n_images = len(prompts) * len(resolutions) * args.batch_size
    try:
        limits.check_seeds(args.seed, n_images)
    except limits.LimitError as e:
        raise CLIError(str(e)) from None
    _check_embedded(args.model, args.size, device, dtype, resolutions, warmup_sizes or [], args.frames)
    if cache is not None:
        _check_embedded_cache(cache, args.model, args.size)
    _check_host_floor(_largest([*resolutions, *(warmup_sizes or [])])[0], args.batch_size)
    folder, single = check_out(args.out, n_images)

    procs = detect_processes(cpu=device.type != "cuda")
    _setup_logging(args.quiet, procs)
    if warmup_sizes and (device.type != "cuda" or mode == "eager"):
        why = "--mode eager" if mode == "eager" else f"this run is on {device}"
        logger.warning("--warmup is ignored: graphs are captured only on a CUDA device and not in mode eager (%s)", why)
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

    def target(name: str) -> Path:
        return single if single is not None else folder / name

    if not args.overwrite:
        # Each process checks the files of its own jobs only: another's may already be appearing.
        # With --parallel every process checks all of rank 0's, so all refuse alike.
        check_existing(folder, single, (name for job in mine for name in job.filenames))
    # Said before the build, so a prompts file far longer than meant is noticed at once.
    logger.info("%d image(s) to make: %d prompt(s) x %d resolution(s) x batch size %d",
                n_images, len(prompts), len(resolutions), args.batch_size)  # fmt: skip
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
        if math.isinf(defaults.cfg_above):
            logger.warning("--negative-prompt is ignored: %s's --guidance feeds a distilled guidance embedding, "
                           "not classifier-free guidance", type(pipe).__name__)  # fmt: skip
        else:
            logger.warning("--negative-prompt is ignored: classifier-free guidance runs only with --guidance above "
                           "%g (this run uses %g)", defaults.cfg_above, guidance)  # fmt: skip
        negative = None
    if negative is None and cfg and defaults.default_negative is not None:
        negative = defaults.default_negative
    if args.guidance is not None and defaults.guidance_kwarg is None:
        logger.warning("%s takes no guidance scale; --guidance %s is ignored", type(pipe).__name__, args.guidance)

    params = inspect.signature(pipe.__call__).parameters
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    check_frames(args.frames, type(pipe).__name__, "num_frames" in params, temporal)
    frames = args.frames or default_frames(args.model, args.size, pipe)

    # Limits that need the built model, still before anything runs or is written.
    warm: list[tuple[int, int]] = []
    graphs = device.type == "cuda" and mode == "bcg"
    if device.type == "cuda" and mode != "eager" and mine and warmup_sizes != []:
        warm = warmup_sizes or list(dict.fromkeys((j.width, j.height) for j in mine))
    warm_cfg = _runs_cfg(guidance, defaults.guidance_kwarg, defaults.cfg_above, params, negative)
    try:
        limits.check_steps(steps, getattr(getattr(pipe, "scheduler", None), "config", None))
        limit = limits.pipeline_position_limit(pipe)
        check_positions(limit, resolutions, "--resolution")
        check_positions(limit, warm, "--warmup")
        # Unknown guidance (the pipeline's own default) may run CFG: plan memory as if it does.
        cfg_memory = cfg or guidance is None
        limits.check_memory(pipe, device, _largest([*resolutions, *warm]), args.batch_size, cfg_memory, graphs)
    except limits.LimitError as e:
        raise CLIError(str(e)) from None

    applied_cache: str | None = None
    if cache is not None:  # before accelerate_pipeline, which then runs the denoiser with its hooks
        check_supported(cache, denoiser_of(pipe), type(pipe).__name__)
        applied_cache = apply_cache(pipe, cache, steps)
        logger.info("step cache: %s", applied_cache)

    warmup_seconds = 0.0
    accelerated = mode != "eager" or args.parallel is not None
    if accelerated:
        from accel import accelerate_pipeline

        options: dict[str, Any] = {}
        if args.parallel is not None:
            options["parallel"] = args.parallel
        if args.compile:  # only when asked: the CLI keeps working with an accel without compile
            options["compile"] = True
            if args.compile_cache is not None:
                options["compile_cache_dir"] = args.compile_cache
        # The components' graphs and automatic breaks likewise: passed only when not the default.
        if not args.text_encoder_graphs:
            options["text_encoder"] = False
        if not args.vae_graphs:
            options["vae"] = False
        if not args.auto_breaks:
            options["auto_breaks"] = False
        if not args.cfg_batch:
            options["cfg_batch"] = False
        try:
            accelerate_pipeline(pipe, mode=mode, **options)
        except (TypeError, ValueError) as e:  # e.g. a hub pipeline with no denoiser to accelerate
            hint = "drop --parallel to split the jobs instead" if args.parallel else "--mode eager runs it as is"
            raise RunError(f"cannot accelerate {type(pipe).__name__}: {_one_line(e)} ({hint})") from None
        if warm:
            try:
                warmup_seconds = _warmup(pipe, warm, mine, negative, warm_cfg, args.batch_size, frames, not args.quiet)
            except torch.OutOfMemoryError:
                sizes = " ".join(f"{w}x{h}" for w, h in warm)
                raise RunError(
                    f"out of memory capturing graphs for {sizes}: use smaller sizes or --warmup none"
                ) from None

    software = f"bcg-diffusers {package_version()}"
    meta_common = dict(
        negative_prompt=negative or "",
        steps=str(steps),
        guidance="default" if guidance is None else f"{guidance:g}",
        model=args.model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        Software=software,
    )
    if applied_cache is not None:
        meta_common["cache"] = applied_cache
    if frames is not None:
        meta_common["frames"] = f"{frames} generated, the first written"

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    takes_output_type = "output_type" in params
    per_prompt = "num_images_per_prompt"
    if per_prompt not in params and "num_videos_per_prompt" in params:  # a video pipeline counts videos
        per_prompt = "num_videos_per_prompt"
    tokens = TruncationWarnings(pipe)
    written: list[Path] = []
    renamed = 0
    made = 0
    modes_ran: set[str] = set()
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
                generator=[torch.Generator(device).manual_seed(s) for s in job.seeds],
            )
            kwargs[per_prompt] = len(job.indices)
            if frames is not None:
                kwargs["num_frames"] = frames
            if takes_output_type:
                kwargs["output_type"] = "np"  # floats, so NaN pixels can be told from black ones
            if negative is not None:
                kwargs["negative_prompt"] = negative
            if guidance is not None and defaults.guidance_kwarg is not None:
                kwargs[defaults.guidance_kwarg] = guidance
            count = tokens.check(job.prompt) if writes else None
            if negative is not None and cfg and writes:
                tokens.check(negative, "negative prompt")
            before = _graph_replays(pipe) if accelerated else None
            t0 = time.perf_counter()
            images = _generate(pipe, kwargs, job, _nan_hint(args), applied_cache)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            gen_seconds += time.perf_counter() - t0
            ran = _mode_ran(pipe, mode, before)
            modes_ran.add(ran)
            for image, index, seed, name in zip(images, job.indices, job.seeds, job.filenames):
                path = target(name)
                info = dict(prompt=job.prompt, seed=str(seed), resolution=f"{job.width}x{job.height}",
                            index=str(index), mode=ran)  # fmt: skip
                if ran != mode:
                    info["requested_mode"] = mode
                if count is not None:
                    info["prompt_tokens"] = count.describe()
                info.update(meta_common)
                made += 1
                if writes:
                    done = save_png(image, path, info, overwrite=args.overwrite)
                    if done != path:
                        renamed += 1
                        logger.warning("%s appeared while this run was generating (another run writing there?): "
                                       "kept it, and wrote %s instead", _shown(path), _shown(done))  # fmt: skip
                    else:
                        logger.info("wrote %s", _shown(done))
                    written.append(done)
                bar.update()

    what = [type(pipe).__name__, _mode_phrase(mode, modes_ran, device)]
    if applied_cache is not None:
        what.append(f"cache {applied_cache}")
    what.append(str(device))
    summary = (
        f"{procs.tag}{made} image(s) in {gen_seconds:.2f} s: warmup {warmup_seconds:.2f} s, "
        f"{gen_seconds / made if made else 0.0:.3f} s/image, "
        f"{len(mine) * steps / gen_seconds if gen_seconds else 0.0:.1f} denoising steps/s, "
        f"graph memory {_graph_mib(pipe, accelerated):.1f} MiB ({', '.join(what)}); "
        + _where(written, folder, single, renamed, writes)
    )
    if tokens.truncated:
        summary += f"; {tokens.truncated} prompt(s) cut at the text encoder's limit"
    print(summary)
    if args.report:
        print(pipe.accel.report() if accelerated else f"{procs.tag}mode eager: the pipeline was not accelerated")
    if procs.state is not None:
        # No barrier: processes share nothing but the folder, and a barrier would need a
        # working collective backend for no benefit.
        procs.state.destroy_process_group()
    return 0


def _check_embedded_cache(cache: CacheRequest, model: str, size: str) -> None:
    """``--cache`` against a built-in model's denoiser, built on the meta device (no storage)."""
    from ..builders import SIZES, build_transformer, canonical_name, pipeline_class

    name = canonical_name(model)
    if name is None or size not in SIZES or not cache.diffusers_hook:
        return
    check_supported(cache, build_transformer(name, size, device="meta"), pipeline_class(name).__name__)


def _graph_replays(pipe: Any) -> int | None:
    """Replays of the denoisers' graphs so far, or None where the accelerator does not tell."""
    try:
        return sum(s.replays for s in pipe.accel.stats().values())
    except Exception:  # an accel without stats(): what ran is then what was asked
        return None


def _mode_ran(pipe: Any, mode: str, before: int | None) -> str:
    """What the denoiser did in the call just made: ``bcg`` only if a graph was replayed."""
    if mode != "bcg" or before is None:
        return mode
    after = _graph_replays(pipe)
    return "bcg" if after is None or after > before else "eager"


def _mode_phrase(mode: str, ran: set[str], device: Any) -> str:
    """``mode bcg``, or what ran instead of the mode asked for, and why."""
    if not ran or ran == {mode}:
        return f"mode {mode}"
    why = "no CUDA device" if device.type != "cuda" else "not every call found a captured graph; see --report"
    return f"mode {'/'.join(sorted(ran))} (--mode {mode} asked, {why})"


def _graph_mib(pipe: Any, accelerated: bool) -> float:
    return pipe.accel.graph_memory_bytes() / 2**20 if accelerated else 0.0


def _where(written: list[Path], folder: Path, single: Path | None, renamed: int, writes: bool) -> str:
    if not writes:
        return "rank 0 writes the files"
    if not written:
        return "nothing written"
    if single is not None and len(written) == 1:
        text = f"wrote {_shown(written[0])}"
    else:
        text = f"wrote {len(written)} file(s) to {_shown(folder)}{os.sep}"
    if renamed:
        text += f" ({renamed} under a free name, as their names were taken meanwhile)"
    return text


def _nan_hint(args: argparse.Namespace) -> str:
    if args.dtype in ("float16", "fp16"):
        return " (float16 overflows in this model: use bfloat16)"
    if args.guidance is not None:
        return f" (--guidance {args.guidance:g} may be too large for this model)"
    return ""


def _runs_cfg(guidance: float | None, kwarg: str | None, above: float, params: Any, negative: str | None) -> bool:
    """Whether this run's calls run classifier-free guidance, so that the warm-up captures them so.

    ``guidance`` is the run's scale, passed as ``kwarg`` (None: the pipeline's own default, read
    from ``params``, its call's parameters); guidance runs above ``above``, and true CFG only
    with a ``negative`` prompt.
    """
    if guidance is None and kwarg in params:
        default = params[kwarg].default
        guidance = default if isinstance(default, (int, float)) and not isinstance(default, bool) else None
    if guidance is None or not guidance > above:
        return False
    return kwarg != "true_cfg_scale" or negative is not None


def _warmup(pipe: Any, resolutions: list[tuple[int, int]], jobs: list[Job], negative: str | None, cfg: bool,
            batch_size: int, frames: int | None, progress: bool) -> float:  # fmt: skip
    """Capture what this run's calls hit: its sizes, prompts, guidance, batch size and frames."""
    kwargs: dict[str, Any] = dict(negative_prompt=negative, cfg=cfg, batch_sizes=(batch_size,), progress=progress)
    if frames is not None:
        kwargs["num_frames"] = frames
    t0 = time.perf_counter()
    pipe.accel.warmup(resolutions, prompts=list(dict.fromkeys(j.prompt for j in jobs)), **kwargs)
    return time.perf_counter() - t0
