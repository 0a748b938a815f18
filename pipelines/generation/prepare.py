"""A pipeline made ready from the model flags: checked, built, its calls' settings resolved, its
limits checked, its step cache applied, accelerated and warmed up.

In that order, each step once. A front end runs the checks that need no model
(:func:`resolve_device_and_dtype`, :func:`check_model`) among its own before it calls
:func:`prepare_pipeline`, so that every bad input is refused before anything is built
(:func:`load_pipeline` runs both). The :class:`PreparedPipeline` then makes one call at a time
(:meth:`PreparedPipeline.generate`); :func:`~pipelines.generation.record.image_texts` and
:func:`~pipelines.generation.formats.encode_image` make each image's record and file bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..lora import LoraSpec
from .caches import CacheRequest, apply_cache, check_supported, denoiser_of
from .calls import CallSettings, Job, call_settings, generate_frames, graph_replays, mode_ran
from .checks import _check_embedded, check_positions, largest_first, resolve_device
from .components import load_loras_checked, load_single_file_denoiser, set_scheduler, warn_lora_scales
from .errors import InputError, RunError, one_line
from .loading import build_model
from .model_flags import ModelSettings, check_quantize, model_settings
from .record import quantized, run_text
from .steps import StepWatch

logger = logging.getLogger(__name__)

Size = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The calls a pipeline is prepared for: its limits are checked against them, and the warm-up
    captures what they will run.

    ``resolutions``: every size a call may use. ``steps``, ``guidance``, ``negative_prompt``,
    ``frames`` and ``fps``: the flags as given (None: the model's default). ``prompts``: those the calls
    of this process encode (the warm-up captures their text encoder's lengths); none: this
    process makes no call, and nothing is warmed up. ``warm_sizes``: the sizes warmed up unless
    ``--warmup`` names others (None: ``resolutions``). ``image``, ``mask`` and ``strength``: every
    call's input image (PIL), mask and strength (:mod:`pipelines.generation.image_input`); ``image_name``
    how the record names the image; ``edits``: calls bring images of their own (a server's edits),
    so a model that needs one is not refused for want of ``image``.
    """

    resolutions: Sequence[Size]
    batch_size: int = 1
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    frames: int | None = None
    prompts: Sequence[str] = ()
    warm_sizes: Sequence[Size] | None = None
    fps: float | None = None
    image: Any = None
    mask: Any = None
    strength: float | None = None
    image_name: str | None = None
    edits: bool = False


@dataclasses.dataclass(frozen=True)
class GeneratedCall:
    """One call's images (PIL; a video's first frame, a layered image's first layer), the mode
    that ran and its seconds; ``videos``: a video pipeline's every frame, one list of PIL frames a
    video (None: images); ``layers``: a layered pipeline's every layer (RGBA), one list an image
    (None: one image each), which a front end writes or answers all of."""

    images: list[Any]
    mode: str
    seconds: float
    videos: list[list[Any]] | None = None
    layers: list[list[Any]] | None = None


@dataclasses.dataclass(frozen=True)
class PreparedPipeline:
    """A pipeline ready for calls. ``cache``: the step cache applied, as described in the PNG
    text (None: none); ``warmup_seconds``: the time the warm-up took; ``loras``: the adapters
    loaded (:func:`pipelines.lora.load_loras`, so named), all active."""

    pipe: Any
    settings: ModelSettings
    device: Any
    dtype: Any
    call: CallSettings
    cache: str | None = None
    warmup_seconds: float = 0.0
    loras: tuple[LoraSpec, ...] = ()

    @property
    def accelerated(self) -> bool:
        return self.settings.accelerated

    def text(self, call: CallSettings | None = None) -> dict[str, str]:
        """The PNG text every image of ``call`` (default: :attr:`call`) shares."""
        return run_text(
            self.settings.model,
            self.device,
            self.dtype,
            call or self.call,
            self.cache,
            self.loras,
            quantized(self.pipe),
            self.scheduler_name,
        )

    @property
    def scheduler_name(self) -> str | None:
        """The class name of the pipeline's scheduler (None: it has none)."""
        scheduler = getattr(self.pipe, "scheduler", None)
        return type(scheduler).__name__ if scheduler is not None else None

    def generate(self, job: Job, hint: str = "", call: CallSettings | None = None, watch: StepWatch | None = None,
                 *, pipe: Any = None, arguments: Mapping[str, Any] | None = None) -> GeneratedCall:  # fmt: skip
        """Make ``job``'s images in one call with ``call`` (default: :attr:`call`); RunError for a
        call that fails or makes non-finite pixels (``hint`` is added: what may have caused them).
        ``watch``: sees each step's end (a progress bar), and may stop the call
        (:class:`~pipelines.generation.steps.CallStopped`).

        ``pipe``: another pipeline of the same components to call (an image-to-image pipeline of
        :func:`~pipelines.generation.image_input.image_pipeline`, accelerated alike); ``arguments``:
        the call's arguments over those of ``call`` for ``job`` (a prompt per image, an input
        image), for a front end that plans its own calls.

        This is the one place a pipeline is called whole. The server's continuous batching drives
        the denoising loop a step at a time instead (:mod:`pipelines.stepwise`, requests joining
        and leaving between steps), in place of this call, on the same settings and records.
        """
        import torch

        kwargs = (call or self.call).kwargs(job, self.device)
        kwargs.update(arguments or {})
        before = graph_replays(self.pipe) if self.accelerated else None
        t0 = time.perf_counter()
        made = generate_frames(pipe or self.pipe, kwargs, job, hint, self.cache, watch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        ran = mode_ran(self.pipe, self.settings.mode, before)
        return GeneratedCall(made.images, ran, seconds, made.videos, made.layers)


def resolve_device_and_dtype(settings: ModelSettings) -> tuple[Any, Any]:
    """The torch device and dtype of ``--device`` and ``--dtype``; InputError for a device not here."""
    import torch

    device = resolve_device(settings.device, settings.mode_flag)
    return device, getattr(torch, settings.dtype_name(device.type))


def check_model(settings: ModelSettings, device: Any, dtype: Any, resolutions: Sequence[Size],
                frames: int | None = None) -> None:  # fmt: skip
    """What can be checked before the model is built (InputError): a local model's folder, and a
    built-in model's limits, step cache and LoRA loader against its configs."""
    _check_embedded(settings.model, settings.size, device, dtype, resolutions, settings.warmup or [], frames)
    check_quantize(settings, device, dtype)
    if settings.cache is not None:
        _check_embedded_cache(settings.cache, settings.model, settings.size)
    if settings.loras:
        _check_embedded_lora_loader(settings.model)


def _check_embedded_lora_loader(model: str) -> None:
    from ..builders import canonical_name, pipeline_class

    name = canonical_name(model)
    if name is not None and not hasattr(pipeline_class(name), "load_lora_weights"):
        raise InputError(
            f"--lora: {pipeline_class(name).__name__} cannot load LoRAs (diffusers gives it no LoRA loader)"
        )


def _check_embedded_cache(cache: CacheRequest, model: str, size: str) -> None:
    """``--cache`` against a built-in model's denoiser, built on the meta device (no storage)."""
    from ..builders import SIZES, build_transformer, canonical_name, pipeline_class

    name = canonical_name(model)
    if name is None or size not in SIZES or not cache.diffusers_hook:
        return
    check_supported(cache, build_transformer(name, size, device="meta"), pipeline_class(name).__name__)


def warn_unused_warmup(settings: ModelSettings, device: Any) -> None:
    """A warning where ``--warmup`` names sizes that will not be captured."""
    if settings.warmup and (device.type != "cuda" or settings.mode == "eager"):
        why = "--mode eager" if settings.mode == "eager" else f"this run is on {device}"
        logger.warning("--warmup is ignored: graphs are captured only on a CUDA device and not in mode eager (%s)", why)


def prepare_pipeline(settings: ModelSettings, workload: Workload, device: Any, dtype: Any, *,
                     progress: bool = True) -> PreparedPipeline:  # fmt: skip
    """Build the pipeline of ``settings`` on ``device``, check it against ``workload``, apply the
    step cache, accelerate it and warm it up (``progress``: the warm-up's progress bars).

    InputError for a workload beyond the built model's limits; RunError for a model that cannot be
    loaded or accelerated, or a warm-up out of memory. Call :func:`check_model` first.
    """
    import torch

    from .. import limits

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graphs are captured on the current device
    warn_lora_scales(settings.loras)  # before the build, which may take minutes
    pipe = build_model(settings.model, settings.size, device, dtype)
    pipe.set_progress_bar_config(disable=True)
    # Whatever changes the weights belongs here: the limits below read them, and the step cache
    # and the accelerator hook the denoiser as it then is.
    if settings.transformer is not None:
        load_single_file_denoiser(pipe, settings.transformer, device, dtype)
    if settings.scheduler is not None:
        set_scheduler(pipe, settings.scheduler)
    loras = load_loras_checked(pipe, settings.loras)
    # With an input image the calls go to the pipeline of the model that takes it (its own, or one
    # diffusers makes of the same components); the warm-up stays on the model's own (``pipe``),
    # whose denoiser calls an image-to-image call repeats, unless the image enters them (an edit model's).
    taking, image_kwargs, image_note = _image_pipeline(pipe, workload)
    called = taking.pipe if taking is not None else pipe
    call = call_settings(called, settings.model, settings.size, workload.steps, workload.guidance,
                         workload.negative_prompt, workload.frames, workload.fps)  # fmt: skip
    for note in call.notes:
        logger.warning("%s", note)
    warm_kwargs = call.conditioning()
    if taking is not None:
        edit = taking.pipe is pipe
        call = dataclasses.replace(call, image_kwargs=image_kwargs, image_note=image_note, image_fit=not edit)
        if edit:
            warm_kwargs.update(image_kwargs or {})

    # Limits that need the built model, still before anything runs.
    warm: list[Size] = []
    if device.type == "cuda" and settings.mode != "eager" and workload.prompts and settings.warmup != ():
        default = workload.resolutions if workload.warm_sizes is None else workload.warm_sizes
        warm = list(settings.warmup or dict.fromkeys(default))
    graphs = device.type == "cuda" and settings.mode == "bcg"
    try:
        limits.check_steps(call.steps, getattr(getattr(pipe, "scheduler", None), "config", None))
        limit = limits.pipeline_position_limit(pipe)
        check_positions(limit, workload.resolutions, "--resolution")
        check_positions(limit, warm, "--warmup")
        # Unknown guidance (the pipeline's own default) may run CFG: plan memory as if it does.
        cfg_memory = call.cfg or call.guidance is None
        largest = largest_first([*workload.resolutions, *warm])
        limits.check_memory(pipe, device, largest, workload.batch_size, cfg_memory, graphs)
    except limits.LimitError as e:
        raise InputError(str(e)) from None

    cache: str | None = None
    if settings.cache is not None:  # before accelerate_pipeline, which then runs the denoiser with its hooks
        check_supported(settings.cache, denoiser_of(pipe), type(pipe).__name__)
        cache = apply_cache(pipe, settings.cache, call.steps)
        logger.info("step cache: %s", cache)

    warmup_seconds = 0.0
    if settings.accelerated:
        _accelerate(pipe, settings)
        if called is not pipe:
            _accelerate(called, settings)  # the same runners: the warm-up's graphs are its own
        if warm:
            try:
                warmup_seconds = _warmup(pipe, warm, workload.prompts, call.negative_prompt, call.warm_cfg,
                                         workload.batch_size, call.frames, progress, warm_kwargs)  # fmt: skip
            except torch.OutOfMemoryError:
                sizes = " ".join(f"{w}x{h}" for w, h in warm)
                raise RunError(
                    f"out of memory capturing graphs for {sizes}: use smaller sizes or --warmup none"
                ) from None
    return PreparedPipeline(called, settings, device, dtype, call, cache, warmup_seconds, loras)


def accelerate_alike(pipe: Any, prepared: PreparedPipeline) -> None:
    """Accelerate ``pipe``, another pipeline of ``prepared``'s components (its image-to-image
    pipeline, say), as ``prepared``'s was: the denoisers' runners, and so their graphs, are shared."""
    if prepared.accelerated and "accel" not in vars(pipe):
        _accelerate(pipe, prepared.settings)


def _image_pipeline(pipe: Any, workload: Workload) -> tuple[Any, dict[str, Any] | None, str | None]:
    """What takes the calls' input image, their image arguments and the record's note of them:
    None without an input image (InputError for a model that needs one), else the pipeline of
    ``pipe``'s model that takes it (:func:`pipelines.generation.image_input.image_pipeline`)."""
    from .image_input import flatten, image_pipeline, mask_from, needs_image

    if workload.image is None:
        if needs_image(type(pipe)) and not workload.edits:
            raise InputError(f"{type(pipe).__name__} edits images: give it one with --image FILE")
        return None, None, None
    taking = image_pipeline(pipe, mask=workload.mask is not None)
    if workload.strength is not None and not taking.strength:
        logger.warning("--strength is ignored: %s takes no strength", type(taking.pipe).__name__)
    mask = mask_from(workload.mask) if workload.mask is not None else None
    kwargs = taking.kwargs(flatten(workload.image, taking.pipe), mask, workload.strength)
    width, height = workload.image.size
    note = f"{workload.image_name or 'an image'} ({width}x{height}), {taking.kind}"
    if "strength" in kwargs:
        note += f", strength {kwargs['strength']:g}"
    if mask is not None:
        note += ", masked"
    logger.info("input image: %s, through %s", note, type(taking.pipe).__name__)
    return taking, kwargs, note


def _accelerate(pipe: Any, settings: ModelSettings) -> None:
    from accel import accelerate_pipeline

    try:
        accelerate_pipeline(pipe, mode=settings.mode, **settings.accelerate_options())
    except (TypeError, ValueError) as e:  # e.g. a hub pipeline with no denoiser to accelerate
        hint = "drop --parallel to split the jobs instead" if settings.parallel else "--mode eager runs it as is"
        raise RunError(f"cannot accelerate {type(pipe).__name__}: {one_line(e)} ({hint})") from None


def _warmup(pipe: Any, resolutions: list[Size], prompts: Sequence[str], negative: str | None, cfg: bool,
            batch_size: int, frames: int | None, progress: bool,
            call_kwargs: dict[str, Any] | None = None) -> float:  # fmt: skip
    """Capture what this run's calls hit: its sizes, prompts, guidance, batch size, frames and
    what every call passes besides (``call_kwargs``: the frame rate a video model is conditioned on)."""
    kwargs: dict[str, Any] = dict(negative_prompt=negative, cfg=cfg, batch_sizes=(batch_size,), progress=progress)
    if frames is not None:
        kwargs["num_frames"] = frames
    if call_kwargs:
        kwargs["call_kwargs"] = call_kwargs
    t0 = time.perf_counter()
    pipe.accel.warmup(resolutions, prompts=list(dict.fromkeys(prompts)), **kwargs)
    return time.perf_counter() - t0


def load_pipeline(model: ModelSettings | argparse.Namespace, workload: Workload, *,
                  progress: bool = True) -> PreparedPipeline:  # fmt: skip
    """The pipeline of the model flags (parsed, or read back by :func:`model_settings`), checked,
    built, accelerated and warmed up for ``workload`` in this process: every step of
    ``bcg-generate`` before its first image. InputError for bad input, RunError for a failure.

    A server, say, prepares for the sizes it serves::

        prepared = load_pipeline(args, Workload(resolutions=[(1024, 1024)], prompts=[DEFAULT_PROMPT]))
        result = prepared.generate(Job(prompt, 1024, 1024, indices=(0,), seeds=(seed,)))
    """
    settings = model_settings(model) if isinstance(model, argparse.Namespace) else model
    device, dtype = resolve_device_and_dtype(settings)
    check_model(settings, device, dtype, workload.resolutions, workload.frames)
    warn_unused_warmup(settings, device)
    return prepare_pipeline(settings, workload, device, dtype, progress=progress)
