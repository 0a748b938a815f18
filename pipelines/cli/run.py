"""main: parse, check, prepare the pipeline, generate and write, report; exit statuses.

Only the standard library is imported here at first: torch, diffusers and accel are imported
inside :func:`main`, so ``--help`` and bad arguments answer at once, and a Ctrl-C or SIGTERM
while they load is reported in one line like any later one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..generation.calls import nan_hint
from ..generation.checks import check_frames_by_name, check_host_floor, largest_first
from ..generation.constants import DEFAULT_PROMPT
from ..generation.defaults import default_resolution, is_video_model
from ..generation.errors import GenerationError, InputError, RunError
from ..generation.formats import format_of
from ..generation.image_input import read_inputs
from ..generation.model_flags import model_settings
from ..generation.prepare import Workload, check_model, prepare_pipeline, resolve_device_and_dtype, warn_unused_warmup
from ..generation.processes import Processes, check_parallel, detect_processes
from ..generation.prompts import TruncationWarnings
from ..generation.record import image_texts, record_size_made
from ..generation.steps import StepWatch
from .arguments import PROG, build_parser
from .files import layer_files, save_image, sweep_stale_parts
from .jobs import file_names, plan_jobs, read_prompts_file, shard
from .outputs import ImageOutput, Renames, check_out, plan_image_output, run_resolutions
from .progress import Progress
from .summary import shown, summary_json, summary_line, where_written
from .terminal import bars_and_logs
from .video import VideoOutput, plan_video_output, resolve_fps, save_video, settle_video_output, video_text

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


def _setup_logging(quiet: bool, procs: Processes, bars: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format=f"%(asctime)s {procs.tag}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger().setLevel(logging.WARNING if quiet else logging.INFO)
    if not bars:  # --quiet, or no terminal: a bar's redraws would pile into the log's lines
        from diffusers.utils import logging as diffusers_logging
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()  # its weight-loading bar
        disable_progress_bars()  # the hub's downloads


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-generate``; returns the exit status (0 ok, 1 failed, 2 bad input, 130 interrupted,
    141 stdout closed, 143 terminated)."""
    with _sigterm_raises():
        try:
            return _run(build_parser().parse_args(argv))
        except GenerationError as e:
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


def _run(args: argparse.Namespace) -> int:
    # Cheap checks first, before anything is built or written; those that need only the flags
    # and the model's name before torch is imported, so that they answer at once.
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    prompts = prompts or [DEFAULT_PROMPT]
    settings = model_settings(args)
    check_frames_by_name(args.model, args.frames)
    video = is_video_model(args.model)  # None: a hub model, known once built
    image, mask = read_inputs(args.image, args.mask, args.strength, video)
    resolutions = run_resolutions(args.resolution, args.width, args.height,
                                  default_resolution(args.model, settings.size), image)  # fmt: skip
    count = args.num_images or args.batch_size
    n_images = len(prompts) * len(resolutions) * count
    folder, single = check_out(args.out, n_images, video)
    media = plan_video_output(single, video, args.fps, args.model)
    files = plan_image_output(args.format, args.quality, single, video)

    from .. import limits  # imports torch

    device, dtype = resolve_device_and_dtype(settings)
    try:
        limits.check_seeds(args.seed, n_images)
    except limits.LimitError as e:
        raise InputError(str(e)) from None
    check_model(settings, device, dtype, resolutions, args.frames)
    batch = min(args.batch_size, count)
    check_host_floor(largest_first([*resolutions, *(settings.warmup or [])])[0], batch, args.frames)

    procs = detect_processes(cpu=device.type != "cuda")
    bars = not args.quiet and sys.stderr.isatty()
    _setup_logging(args.quiet, procs, bars)
    warn_unused_warmup(settings, device)
    if video and media is not None and not media.every_frame:
        _say_first_frame(single)
    if procs.count > 1 and procs.device is not None and device.type != "cpu" and procs.device.type == device.type:
        device = procs.device  # each process on its own GPU
    jobs = plan_jobs(prompts, resolutions, args.batch_size, args.seed, count)
    check_parallel(args.parallel, procs)
    # --parallel: every process takes part in every job (same seeds); rank 0 writes the files.
    mine = list(jobs) if args.parallel is not None else shard(jobs, procs.index, procs.count)
    writes = args.parallel is None or procs.index == 0
    renames = Renames()

    def check_names(media: VideoOutput | None) -> None:
        if not args.overwrite and writes:
            # Each process looks at the files of its own jobs only: another's may already be appearing.
            suffix = _suffix(media, files)
            renames.plan(folder, single, (name for job in mine for name in file_names(job, suffix)))

    check_names(media)
    # Said before the build, so a prompts file far longer than meant is noticed at once.
    logger.info("%d %s(s) to make: %d prompt(s) x %d resolution(s) x %d in calls of %d", n_images,
                "video" if video else "image", len(prompts), len(resolutions), count, batch)  # fmt: skip
    if procs.count > 1:
        logger.info("%d of %d jobs on %s", len(mine), len(jobs), device)

    workload = Workload(resolutions, batch, args.steps, args.guidance, args.negative_prompt, args.frames,
                        prompts=[j.prompt for j in mine], warm_sizes=[(j.width, j.height) for j in mine],
                        fps=args.fps, image=image, mask=mask, strength=args.strength,
                        image_name=args.image.name if args.image else None)  # fmt: skip
    with bars_and_logs() if bars else contextlib.nullcontext():  # the warm-up's progress bars
        prepared = prepare_pipeline(settings, workload, device, dtype, progress=bars)
    call, common = prepared.call, prepared.text()
    if video is None:  # now known: a video model keeps the plan, an image model writes image files
        settled = settle_video_output(media, prepared.pipe, single, args.fps)
        files = plan_image_output(args.format, args.quality, single, settled is not None and settled.every_frame)
        if _suffix(settled, files) != _suffix(media, files):
            check_names(settled)
        if settled is not None and not settled.every_frame:
            _say_first_frame(single)
        media = settled
    every_frame = media is not None and media.every_frame
    if call.layered and media is None and files.fmt == "jpeg":
        raise InputError(f"{type(prepared.pipe).__name__} makes each image as RGBA layers, and JPEG has no alpha: "
                         "write them as PNG or WebP (--format png or webp)")  # fmt: skip
    fps = resolve_fps(media, prepared.pipe) if every_frame else None

    tokens = TruncationWarnings(prepared.pipe)
    hint = nan_hint(args.dtype, args.guidance)
    written: list[Path] = []
    records: list[dict[str, Any]] = []
    renamed = made = layers = 0
    modes_ran: set[str] = set()
    gen_seconds = 0.0
    unit = "video" if every_frame else "image"
    progress = Progress(sum(len(j.indices) for j in mine), len(mine), call.steps, enabled=not args.quiet,
                        tag=procs.tag, position=procs.index if procs.count > 1 else None, unit=unit)  # fmt: skip
    swept: set[Path] = set()
    with bars_and_logs() if progress.tty else contextlib.nullcontext(), progress:
        for job in mine:
            count_tokens = tokens.check(job.prompt) if writes else None
            if call.negative_prompt is not None and call.cfg and writes:
                tokens.check(call.negative_prompt, "negative prompt")
            result = prepared.generate(job, hint, watch=StepWatch(on_step=progress.step))
            gen_seconds += result.seconds
            modes_ran.add(result.mode)
            texts = image_texts(job, common, result.mode, settings.mode, count_tokens)
            if every_frame and result.videos is None:
                raise RunError(f"{type(prepared.pipe).__name__} returned images, not a video's frames: "
                               "write them with --out x.png or a folder of PNGs")  # fmt: skip
            items = result.videos if every_frame and result.videos is not None else result.images
            if made_size := record_size_made(items[0] if not every_frame else items[0][0], job, texts):
                logger.warning("the pipeline made %dx%d images where %dx%d was asked (its own rule); the files "
                               "record the size made", *made_size, job.width, job.height)  # fmt: skip
            stacks = result.layers or [None] * len(items)
            for item, stack, text, name, seed in zip(items, stacks, texts, file_names(job, _suffix(media, files)),
                                                     job.seeds):  # fmt: skip
                path = renames.target(folder, single, name)
                made += 1
                if not writes:
                    continue
                if path.parent not in swept:
                    swept.add(path.parent)
                    if removed := sweep_stale_parts(path.parent):
                        logger.info("removed %d part file(s) that killed runs left in %s", removed, shown(path.parent))
                # A layered image is its layers, each a file of its own (NAME-layerK), RGBA kept.
                parts = [(item, path, text)] if stack is None else list(layer_files(stack, path, text))
                for image, target, record in parts:
                    if fps is not None:  # every frame, in a video file
                        done = save_video(image, target, video_text(record, len(image), fps), fps, args.overwrite)
                    else:
                        fmt = files.fmt if media is None else (format_of(target) or "png")
                        done = save_image(image, target, record, fmt, files.quality, overwrite=args.overwrite)
                    if done != target:
                        renamed += 1
                        logger.warning("%s appeared while this run was generating (another run writing there?): "
                                       "kept it, and wrote %s instead", shown(target), shown(done))  # fmt: skip
                    else:
                        logger.info("wrote %s", shown(done))
                    written.append(done)
                    entry = dict(file=str(done), prompt=job.prompt, seed=seed, width=job.width, height=job.height,
                                 index=int(text["index"]))  # fmt: skip
                    if "layer" in record:
                        entry["layer"] = int(record["layer"])
                    records.append(entry)
                    layers = len(stack) if stack is not None else 0
            progress.call_done(len(job.indices))

    where = where_written(written, folder, single, renamed, writes, layers, files.suffix)
    line = summary_line(prepared, procs.tag, made, len(mine), gen_seconds, modes_ran, where, tokens.truncated, unit)
    report = (prepared.pipe.accel.report() if prepared.accelerated else
              f"{procs.tag}mode eager: the pipeline was not accelerated")  # fmt: skip
    if args.json:
        sys.stderr.write(line + "\n")
        summary = summary_json(prepared, made, len(mine), gen_seconds, modes_ran, records, tokens.truncated, unit)
        if args.report:
            summary["report"] = report
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(line)
        if args.report:
            print(report)
    if procs.state is not None:
        # No barrier: processes share nothing but the folder, and a barrier would need a
        # working collective backend for no benefit.
        procs.state.destroy_process_group()
    return 0


def _suffix(media: VideoOutput | None, files: ImageOutput) -> str:
    """The suffix of the run's files: the video container's (or the first frame's file), else the images' format's."""
    return media.suffix if media is not None else files.suffix


def _say_first_frame(single: Path | None) -> None:
    logger.warning("--out %s holds one image: each video's first frame is written (name a .webp, .gif or .mp4 "
                   "file, or a folder, for every frame)", shown(single) if single else "")  # fmt: skip
