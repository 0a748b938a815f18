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
Ctrl-C is status 130, SIGTERM 143. Nothing is written before the checks pass, an image file
appears only once it is complete (written to a hidden ``.part`` file of its own, then renamed),
and an existing image is never replaced without ``--overwrite``.

Importing this package imports no torch: ``--help`` and argument errors answer at once.

The modules, one job each:

errors      :class:`CLIError` (status 2) and :class:`RunError` (status 1)
jobs        :class:`Job`, ``plan_jobs``, ``shard`` and the image file names
arguments   ``build_parser``: each value checked as it is read
checks      checks that need no model: prompts file, device, ``--out``, existing images,
            compile cache, limits
caches      ``--cache``: the step caches of diffusers and cache-dit, checked and applied
prompts     token counts, so a prompt the text encoder cuts is said
defaults    ``generation_defaults``: steps and guidance from the model's recipe (or, for FLUX.1
            and Wan2.1, a table); a built-in video model's resolution and frames
loading     ``build_model``: library warnings held back, load errors in one line
processes   one process or those of an accelerate launch
images      one pipeline call to images, and an image to a PNG file
run         ``main``: checks, build, warmup, generation, summary
"""

from __future__ import annotations

import sys

from ..lazy import lazy_exports

# __all__ stays the API it was when the CLI was one module; the other names that module had are
# still importable from here. All are loaded on first use (PEP 562), so that starting
# bcg-generate imports almost nothing before main() can catch a Ctrl-C.
__getattr__, __dir__, _ = lazy_exports(
    __name__,
    {
        "arguments": ("DEFAULT_MODEL", "DEFAULT_PROMPT", "DEFAULT_RESOLUTION", "DTYPES", "PROG", "build_parser"),
        "checks": ("HOST_BYTES_PER_PIXEL", "check_out", "read_prompts_file", "resolve_device"),
        "defaults": ("generation_defaults",),
        "errors": ("CLIError", "RunError"),
        "jobs": ("Job", "image_filename", "plan_jobs", "shard", "slug"),
        "loading": ("build_model",),
        "processes": ("Processes", "detect_processes"),
    },
)


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-generate``; returns the exit status (0 ok, 1 failed, 2 bad input, 130
    interrupted, 143 terminated). See :func:`pipelines.cli.run.main`."""
    try:
        from .run import main as run
    except KeyboardInterrupt:  # while the CLI's own modules load: one line, like any later Ctrl-C
        sys.stderr.write("bcg-generate: interrupted\n")
        return 130
    return run(argv)


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
