"""The generation core: a diffusers pipeline made ready from the model flags, and its calls made
into images and their files' bytes. ``bcg-generate`` (:mod:`pipelines.cli`) and ``bcg-serve``
(:mod:`pipelines.serve`) are two front ends over it; neither imports the other.

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)                       # --model, --mode, --compile, --cache, --lora ...
    settings = model_settings(parser.parse_args())    # checked, before torch is imported
    prepared = load_pipeline(settings, Workload(resolutions=[(1024, 1024)], prompts=[DEFAULT_PROMPT]))
    job = Job("a red fox", 1024, 1024, indices=(0,), seeds=(7,))
    made = prepared.generate(job)
    texts = image_texts(job, prepared.text(), made.mode, settings.mode)
    data = encode_image(made.images[0], texts[0], "png")

Two functions carry it: :func:`prepare_pipeline` (checked, built, its calls' settings resolved,
its limits checked, step cache, accelerated, warmed up; :func:`load_pipeline` runs the checks
that need no model first) and :meth:`PreparedPipeline.generate` (one pipeline call: its
arguments, errors in one line, non-finite pixels refused, the mode that ran). A front end that
plans its own calls resolves a call's settings with :func:`call_settings`. Bad input is
:class:`InputError`, a failure :class:`RunError`; both are one line. Importing this package
imports no torch: the flags are read and checked before it loads.

The modules, one job each:

errors      :class:`InputError` and :class:`RunError`, each told in one line
constants   the defaults and bounds of the flags, accel's standard-library modules (its options,
            the parallel modes' process counts) loaded without torch, the version
extras      the optional extras, and the one line naming the install command of a missing one
values      each flag's value, checked as it is read
caches      ``--cache``: the step caches of diffusers and cache-dit, checked and applied
model_flags ``add_model_arguments`` and ``model_settings``: the model flags (model, size, device,
            dtype, mode, compile, step cache, graphs, warm-up, LoRA) as a :class:`ModelSettings`
checks      checks that need no model: device, compile cache, a built-in model's limits, frames
defaults    ``generation_defaults``: steps and guidance from the model's recipe or its family's
            record; a built-in video model's resolution and frames
loading     ``build_model``: library warnings held back, load errors in one line
prompts     token counts, so a prompt the text encoder cuts is said
image_input which pipeline takes an input image (the model's own, or diffusers' image-to-image
            or inpainting pipeline of its components), masks, images read
steps       ``StepWatch``: each denoising step's end (progress, a call stopped at a step boundary)
calls       :class:`Job` and ``call_settings``: a call's settings against the model's defaults;
            one pipeline call to images, and the mode it ran in
components  the parts swapped in before acceleration: ``--scheduler``, ``--transformer`` (a
            single-file denoiser), ``--lora``
prepare     ``prepare_pipeline`` and ``load_pipeline``: checked, built, limits, step cache,
            accelerated, warmed up; :class:`PreparedPipeline` and its ``generate``
record      the text each image carries (A1111's ``parameters`` too)
png         PNG bytes with text chunks, fast
formats     an image as a PNG, JPEG or WebP file with its record, read back (``read_image_text``)
processes   one process, or those of an accelerate launch or torchrun, and which one this is
"""

from __future__ import annotations

from ..lazy import lazy_exports

# Loaded on first use (PEP 562): the front ends parse their flags before torch is imported.
__getattr__, __dir__, _ = lazy_exports(
    __name__,
    {
        "calls": ("CallSettings", "Job", "call_settings"),
        "constants": ("DEFAULT_PROMPT",),
        "defaults": ("generation_defaults",),
        "errors": ("GenerationError", "InputError", "RunError"),
        "formats": ("encode_image",),
        "model_flags": ("ModelSettings", "add_model_arguments", "model_settings"),
        "prepare": (
            "GeneratedCall",
            "PreparedPipeline",
            "Workload",
            "check_model",
            "load_pipeline",
            "prepare_pipeline",
            "resolve_device_and_dtype",
        ),
        "record": ("image_texts", "run_text"),
        "steps": ("CallStopped", "StepWatch"),
    },
)

__all__ = [
    "DEFAULT_PROMPT",
    "CallSettings",
    "CallStopped",
    "GeneratedCall",
    "GenerationError",
    "InputError",
    "Job",
    "ModelSettings",
    "PreparedPipeline",
    "RunError",
    "StepWatch",
    "Workload",
    "add_model_arguments",
    "call_settings",
    "check_model",
    "encode_image",
    "generation_defaults",
    "image_texts",
    "load_pipeline",
    "model_settings",
    "prepare_pipeline",
    "resolve_device_and_dtype",
    "run_text",
]
