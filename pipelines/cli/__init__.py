"""bcg-generate: generate images with a diffusers pipeline whose denoiser replays CUDA graphs.

    bcg-generate --prompt "a red fox in the snow" --out outputs/fox.png
    bcg-generate --model qwen-image --resolution 512x512 768x512 --batch-size 2
    accelerate launch --num_processes 2 scripts/generate.py --prompts-file samples/prompts.txt

The work is a list of jobs, one pipeline call each: every (prompt, resolution) pair, in that
order, makes ``--batch-size`` images. Image ``i`` of a run (counted over the whole run) uses seed
``--seed + i`` and is written as ``{i:04d}-{slug}-{W}x{H}-s{seed}.png`` (a video model's videos:
``.webp``, or the container ``--out`` names), so names and pixels do not depend on how many
processes share the work. Under ``accelerate launch`` each process takes a
contiguous share of the jobs (the split of ``PartialState.split_between_processes``), runs on its
own device and captures its own graphs.

The CLI lives in ``pipelines`` (the layer that knows models), not in ``accel``: it builds models
through :mod:`pipelines.builders`, and ``accel`` never imports ``pipelines``.

Bad input is one line on stderr and exit status 2 (a request beyond a limit of
:mod:`pipelines.limits` included); a failure while loading or generating is one line and status 1;
Ctrl-C is status 130, SIGTERM 143. Nothing is written before the checks pass, an image file
appears only once it is complete (written to a hidden ``.part`` file of its own, then renamed),
and an existing image is never replaced without ``--overwrite``: the new one takes a free name.

Importing this package imports no torch: ``--help`` and argument errors answer at once.

A second front end (a server, say) reuses the model flags and the pipeline they make:
:func:`add_model_arguments` adds the flags to its parser, :func:`load_pipeline` turns them into a
:class:`PreparedPipeline` (checked, built, accelerated, warmed up), whose
:meth:`~PreparedPipeline.generate` makes one call's images and :func:`call_pngs` their PNG bytes,
with the text the CLI writes into its files.

The modules, one job each:

errors      :class:`CLIError` (status 2) and :class:`RunError` (status 1)
constants   the CLI's constants, accel's options loaded without torch, the package version
values      each flag's value, checked as it is read
model_flags ``add_model_arguments`` and ``model_settings``: the model flags (model, size, device,
            dtype, mode, compile, step cache, graphs, warm-up, LoRA), shared by every front end
arguments   ``build_parser``: the model flags, what to generate, output; the help's epilog
jobs        :class:`Job`, ``plan_jobs``, ``shard`` and the image file names
checks      checks that need no model: prompts file, device, ``--out``, existing images,
            compile cache, limits
caches      ``--cache``: the step caches of diffusers and cache-dit, checked and applied
prompts     token counts, so a prompt the text encoder cuts is said
defaults    ``generation_defaults``: steps and guidance from the model's recipe (or, for FLUX.1
            and Wan2.1, a table); a built-in video model's resolution and frames
loading     ``build_model``: library warnings held back, load errors in one line
steps       ``StepWatch``: each denoising step's end (progress, a call stopped at a step boundary)
calls       ``call_settings``: the run's flags against the model's defaults; one pipeline call
            to images, and the mode it ran in
prepare     ``prepare_pipeline`` and ``load_pipeline``: checked, built, limits, step cache,
            accelerated, warmed up
image_input which pipeline takes an input image (the model's own, or diffusers' image-to-image
            or inpainting pipeline of its components), masks, images read
outputs     the run's sizes, its image files' format, and new names for files that exist
formats     an image as a PNG, JPEG or WebP file with its record, read back (``read_image_text``)
progress    the run's step bar on a terminal, its progress lines elsewhere
images      the text of each image (A1111's ``parameters`` too), its PNG bytes (``call_pngs``),
            a file that appears whole, part files of killed runs swept
video       a video model's every frame: WebP, GIF or MP4 by --out's suffix, the text in each
            container's metadata (``read_video_text``), the frame rate
processes   one process or those of an accelerate launch
summary     the run's closing line
run         ``main``: checks, prepare, generation, summary; exit statuses and signals
"""

from __future__ import annotations

import sys

from ..lazy import lazy_exports

# __all__: the CLI's API and the pieces another front end reuses; the other names the CLI had when it
# was one module are still importable from here. All are loaded on first use (PEP 562), so that starting
# bcg-generate imports almost nothing before main() can catch a Ctrl-C.
__getattr__, __dir__, _ = lazy_exports(
    __name__,
    {
        "arguments": ("build_parser",),
        "calls": ("CallSettings", "call_settings"),
        "checks": ("HOST_BYTES_PER_PIXEL", "check_out", "read_prompts_file", "resolve_device"),
        "constants": ("DEFAULT_MODEL", "DEFAULT_PROMPT", "DEFAULT_RESOLUTION", "DTYPES", "PROG"),
        "defaults": ("generation_defaults",),
        "errors": ("CLIError", "RunError"),
        "images": ("call_pngs", "image_texts", "png_bytes", "run_text"),
        "jobs": ("Job", "image_filename", "plan_jobs", "shard", "slug"),
        "loading": ("build_model",),
        "model_flags": ("ModelSettings", "add_model_arguments", "model_settings"),
        "prepare": ("GeneratedCall", "PreparedPipeline", "Workload", "load_pipeline", "prepare_pipeline"),
        "processes": ("Processes", "detect_processes"),
        "steps": ("CallStopped", "StepWatch"),
        "video": ("read_video_text", "save_video"),
        "formats": ("encode_image", "read_image_text"),
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
    "CallSettings",
    "CallStopped",
    "GeneratedCall",
    "Job",
    "ModelSettings",
    "PreparedPipeline",
    "RunError",
    "StepWatch",
    "Workload",
    "add_model_arguments",
    "build_parser",
    "call_pngs",
    "call_settings",
    "generation_defaults",
    "load_pipeline",
    "main",
    "model_settings",
    "plan_jobs",
    "png_bytes",
    "prepare_pipeline",
    "read_image_text",
    "read_video_text",
    "save_video",
    "shard",
    "slug",
]
