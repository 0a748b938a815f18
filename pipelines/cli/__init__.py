"""bcg-generate: generate images with a diffusers pipeline whose denoiser replays CUDA graphs.

    bcg-generate --prompt "a red fox in the snow" --out outputs/fox.png
    bcg-generate --model qwen-image --resolution 512x512 768x512 --batch-size 2
    accelerate launch --num_processes 2 scripts/generate.py --prompts-file samples/prompts.txt

The work is a list of jobs, one pipeline call each: every (prompt, resolution) pair, in that
order, makes ``--batch-size`` images. Image ``i`` of a run (counted over the whole run) uses seed
``--seed + i`` and is written as ``{i:04d}-{slug}-{W}x{H}-s{seed}.png`` (a video model's videos:
``.webp``, or the container ``--out`` names; a layered model's images: one RGBA file a layer,
``NAME-layer0.png`` ...), so names and pixels do not depend on how many processes share the work. Under ``accelerate launch`` each process takes a
contiguous share of the jobs (the split of ``PartialState.split_between_processes``), runs on its
own device and captures its own graphs.

The CLI is a front end over the generation core (:mod:`pipelines.generation`): the model flags,
the pipeline they make, its calls and each image's record and bytes are the core's, shared with
``bcg-serve``; what is the CLI's own is below. It lives in ``pipelines`` (the layer that knows
models), not in ``accel``: ``accel`` never imports ``pipelines``.

Bad input is one line on stderr and exit status 2 (a request beyond a limit of
:mod:`pipelines.limits` included); a failure while loading or generating is one line and status 1;
Ctrl-C is status 130, SIGTERM 143. Nothing is written before the checks pass, an image file
appears only once it is complete (written to a hidden ``.part`` file of its own, then renamed),
and an existing image is never replaced without ``--overwrite``: the new one takes a free name.

Importing this package imports no torch: ``--help`` and argument errors answer at once.

The modules, one job each:

arguments   ``build_parser``: the model flags, what to generate, output; the help's epilog
jobs        the prompts file read, ``plan_jobs``, ``shard`` and the image file names
outputs     the run's sizes, ``--out`` checked, its image files' format, new names for files
            that exist
files       a file that appears whole, part files of killed runs swept
video       a video model's every frame: WebP, GIF or MP4 by --out's suffix, the text in each
            container's metadata (``read_video_text``), the frame rate
progress    the run's step bar on a terminal, its progress lines elsewhere
terminal    log lines above the progress bars, whichever library logs them
summary     the run's closing line
run         ``main``: checks, prepare, generation, summary; exit statuses and signals
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-generate``; returns the exit status (0 ok, 1 failed, 2 bad input, 130
    interrupted, 143 terminated). See :func:`pipelines.cli.run.main`."""
    try:
        from .run import main as run
    except KeyboardInterrupt:  # while the CLI's own modules load: one line, like any later Ctrl-C
        sys.stderr.write("bcg-generate: interrupted\n")
        return 130
    return run(argv)
