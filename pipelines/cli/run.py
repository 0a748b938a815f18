"""main: parse, check, build, warm up, generate and write, report."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import limits
from .arguments import DEFAULT_PROMPT, DEFAULT_RESOLUTION, DTYPES, PROG, build_parser
from .checks import (
    _check_compile_cache,
    _check_embedded,
    _check_host_floor,
    check_out,
    read_prompts_file,
    resolve_device,
)
from .defaults import generation_defaults
from .errors import CLIError, RunError, _one_line
from .images import _generate, _save_png
from .jobs import Job, plan_jobs, shard
from .loading import build_model
from .processes import Processes, detect_processes

logger = logging.getLogger("bcg-generate")


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
    if args.auto_breaks and mode == "eager":
        raise CLIError("--auto-breaks changes how graphs are captured, which --mode eager never does: drop one of them")
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
        # The components' graphs and automatic breaks likewise: passed only when not the default.
        if not args.text_encoder_graphs:
            options["text_encoder"] = False
        if not args.vae_graphs:
            options["vae"] = False
        if args.auto_breaks:
            options["auto_breaks"] = True
        if not args.cfg_batch:
            options["cfg_batch"] = False
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


def _nan_hint(args: argparse.Namespace) -> str:
    if args.dtype in ("float16", "fp16"):
        return " (float16 overflows in this model: use bfloat16)"
    if args.guidance is not None:
        return f" (--guidance {args.guidance:g} may be too large for this model)"
    return ""


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
