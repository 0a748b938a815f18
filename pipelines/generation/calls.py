"""One pipeline call: the run's settings resolved against the model's defaults, the call's
arguments, the call itself (errors in one line, non-finite pixels refused) and what ran."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from typing import Any

from .checks import check_frames
from .defaults import default_frames, generation_defaults
from .errors import RunError, one_line
from .steps import CallStopped, StepWatch, end_stopped_call, takes_step_callback


@dataclasses.dataclass(frozen=True)
class Job:
    """One pipeline call: ``len(indices)`` images of one prompt at one resolution.

    ``indices`` number the images of a whole run (a front end's file names and records use
    them) and ``seeds[k]`` is image ``k``'s seed: its generator's, so its noise is its own.
    """

    prompt: str
    width: int
    height: int
    indices: tuple[int, ...]
    seeds: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """How every call of a run is made, the flags resolved against the pipeline's defaults.

    ``guidance`` None leaves the pipeline's own default; ``cfg``: classifier-free guidance runs
    by the scale given (``warm_cfg``: also by the pipeline's own default, so that the warm-up
    captures what the calls do). ``frames``: a video pipeline's frame count, None for images.
    ``frame_rate``: the argument and value of ``--fps`` for a pipeline conditioned on its frame
    rate (LTX-Video's ``frame_rate``); None leaves the pipeline's own. ``image_kwargs``: the input
    image every call passes (``image``, ``mask_image``, ``strength``; :mod:`pipelines.generation.image_input`),
    ``image_note`` says what it was in the images' record, ``image_fit``: it is resized to each
    call's size first (an image-to-image pipeline's latents are its image's). ``takes_size``: the
    call takes ``height`` and ``width`` (a pipeline that makes its size from its input image takes
    neither); ``takes_max_area``: it also takes ``max_area``, to which it would scale them (FLUX.1
    Kontext's 1024x1024): set to the size asked, so that the size made is the size asked.
    ``layered``: the call takes ``layers`` and makes each image as that many RGBA layers (Qwen-Image
    Layered): a front end writes or answers every layer, never one alone. ``notes``: the flags
    given that the pipeline does not use, each a line for the user who gave them (a front end that
    plans a call per request, whose records say what ran, can pass them by).
    """

    steps: int
    guidance: float | None
    negative_prompt: str | None
    cfg: bool
    warm_cfg: bool
    frames: int | None
    guidance_kwarg: str | None
    count_kwarg: str = "num_images_per_prompt"
    takes_output_type: bool = True
    frame_rate: tuple[str, float] | None = None
    image_kwargs: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    image_note: str | None = None
    takes_size: bool = True
    image_fit: bool = False
    takes_max_area: bool = False
    layered: bool = False
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def kwargs(self, job: Job, device: Any) -> dict[str, Any]:
        """The pipeline's keyword arguments for ``job`` (its generators on ``device``)."""
        import torch

        kwargs: dict[str, Any] = dict(
            prompt=job.prompt,
            num_inference_steps=self.steps,
            generator=[torch.Generator(device).manual_seed(s) for s in job.seeds],
        )
        if self.takes_size:
            kwargs.update(height=job.height, width=job.width)
            if self.takes_max_area:
                kwargs["max_area"] = job.height * job.width
        kwargs[self.count_kwarg] = len(job.indices)
        if self.frames is not None:
            kwargs["num_frames"] = self.frames
        if self.takes_output_type:
            # Floats, so NaN pixels can be told from black ones: an image pipeline's as the tensor
            # it decoded, checked and made 8-bit on its device (generate_frames), a video
            # pipeline's frames as numpy.
            kwargs["output_type"] = "np" if self.video else "pt"
        if self.negative_prompt is not None:
            kwargs["negative_prompt"] = self.negative_prompt
        if self.guidance is not None and self.guidance_kwarg is not None:
            kwargs[self.guidance_kwarg] = self.guidance
        kwargs.update(self.conditioning())
        if self.image_kwargs:
            from .image_input import fitted

            kwargs.update(fitted(self.image_kwargs, (job.width, job.height)) if self.image_fit else self.image_kwargs)
        return kwargs

    @property
    def video(self) -> bool:
        """Whether the pipeline makes videos (it takes a frame count, or counts videos)."""
        return self.frames is not None or self.count_kwarg != "num_images_per_prompt"

    def conditioning(self) -> dict[str, Any]:
        """What every call passes beyond the job's own arguments, warm-up calls too (the frame
        rate a video model is conditioned on enters its graphs' inputs)."""
        return dict([self.frame_rate]) if self.frame_rate is not None else {}


def call_settings(pipe: Any, model: str, size: str, steps: int | None = None, guidance: float | None = None,
                  negative_prompt: str | None = None, frames: int | None = None,
                  fps: float | None = None) -> CallSettings:  # fmt: skip
    """``--steps``, ``--guidance``, ``--negative-prompt``, ``--frames`` and ``--fps`` (None: not
    given) for ``pipe``, built as ``model`` at ``size``; a negative prompt or guidance that the
    pipeline would not use is dropped, and said in :attr:`CallSettings.notes`; InputError is
    raised for frames it cannot make. ``--fps`` reaches a pipeline whose call takes ``frame_rate`` (or ``fps``), which its
    model is conditioned on; for others it is the file's frame rate only."""
    defaults = generation_defaults(pipe)
    scale = guidance if guidance is not None else defaults.guidance
    cfg = scale is not None and scale > defaults.cfg_above
    negative = negative_prompt
    notes: list[str] = []
    if negative is not None and scale is not None and not cfg:
        if math.isinf(defaults.cfg_above):
            notes.append(f"--negative-prompt is ignored: {type(pipe).__name__}'s --guidance feeds a distilled "
                         "guidance embedding, not classifier-free guidance")  # fmt: skip
        else:
            notes.append(f"--negative-prompt is ignored: classifier-free guidance runs only with --guidance above "
                         f"{defaults.cfg_above:g} (this run uses {scale:g})")  # fmt: skip
        negative = None
    if negative is None and cfg and defaults.default_negative is not None:
        negative = defaults.default_negative
    if guidance is not None and defaults.guidance_kwarg is None:
        notes.append(f"{type(pipe).__name__} takes no guidance scale; --guidance {guidance} is ignored")

    params = inspect.signature(pipe.__call__).parameters
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    check_frames(frames, type(pipe).__name__, "num_frames" in params, temporal)
    count_kwarg = "num_images_per_prompt"
    if count_kwarg not in params and "num_videos_per_prompt" in params:  # a video pipeline counts videos
        count_kwarg = "num_videos_per_prompt"
    return CallSettings(
        steps=steps or defaults.steps,
        guidance=scale,
        negative_prompt=negative,
        cfg=cfg,
        warm_cfg=runs_cfg(scale, defaults.guidance_kwarg, defaults.cfg_above, params, negative),
        frames=frames or default_frames(model, size, pipe),
        guidance_kwarg=defaults.guidance_kwarg,
        count_kwarg=count_kwarg,
        takes_output_type="output_type" in params,
        frame_rate=_frame_rate(params, fps),
        takes_size=("height" in params and "width" in params) or _any_keyword(params),
        takes_max_area="max_area" in params,
        layered="layers" in params,
        notes=tuple(notes),
    )


def _any_keyword(params: Any) -> bool:
    """Whether a call takes any keyword (``**kwargs``: a wrapper of another call, say)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _frame_rate(params: Any, fps: float | None) -> tuple[str, float] | None:
    """The call's frame-rate argument set to ``fps``, where it has one (LTX-Video's ``frame_rate``
    is an int: a whole rate is passed as one)."""
    if fps is None:
        return None
    for name in ("frame_rate", "fps"):
        if name in params:
            return name, int(fps) if float(fps).is_integer() else fps
    return None


def runs_cfg(guidance: float | None, kwarg: str | None, above: float, params: Any, negative: str | None) -> bool:
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


def nan_hint(dtype: str | None, guidance: float | None, guidance_name: str = "--guidance") -> str:
    """What may have made NaN pixels, from ``--dtype`` and the guidance as given (named
    ``guidance_name``, as the front end's user knows it)."""
    if dtype in ("float16", "fp16"):
        return " (float16 overflows in this model: use bfloat16)"
    if guidance is not None:
        return f" ({guidance_name} {guidance:g} may be too large for this model)"
    return ""


@dataclasses.dataclass(frozen=True)
class Pixels:
    """What one call made, as PIL images: one per image of its job (a video's first frame, an
    image's first layer); ``videos``: a video pipeline's every frame, one list a video;
    ``layers``: a layered pipeline's every layer (RGBA), one list an image, in the pipeline's
    order. None where the call made neither."""

    images: list[Any]
    videos: list[list[Any]] | None = None
    layers: list[list[Any]] | None = None


def generate_frames(pipe: Any, kwargs: dict[str, Any], job: Job, hint: str, cache: str | None = None,
                    watch: StepWatch | None = None) -> Pixels:  # fmt: skip
    """One pipeline call -> its PIL images (:class:`Pixels`): for a video pipeline (output
    ``frames``, not ``images``) every frame of each video too, and for a layered pipeline (its
    output a stack of layers per image, Qwen-Image Layered's) every layer of each image. RunError
    for out-of-memory or non-finite pixels; every frame is checked, since a NaN anywhere says the call went wrong. ``cache``: the step cache applied (its description),
    if any: a cache hook that fails inside the call is told in one line with the cache named,
    since it, not the pipeline, is the suspect. ``watch``: sees every step's end where the
    pipeline takes ``callback_on_step_end`` (:class:`~pipelines.generation.steps.StepWatch`); a call it
    stops raises :class:`~pipelines.generation.steps.CallStopped`, the pipeline's end run.

    An image pipeline asked for ``output_type="pt"`` (:meth:`CallSettings.kwargs`) hands back the
    batch it decoded, still on its device: it is checked there (one sync) and made 8-bit there
    (:func:`accel.to_pil_images`), the images diffusers' ``numpy_to_pil`` makes of its ``"np"``
    output, bit for bit, without the host's float work. ``"np"`` output (video frames, or a
    pipeline that gives numpy whatever it is asked) is checked and converted on the host.
    """
    import numpy as np
    import torch

    from accel import ParallelError, check_pixels, to_pil_images

    if watch is not None and takes_step_callback(pipe):
        kwargs = {**kwargs, "callback_on_step_end": watch}
    try:
        output = pipe(**kwargs)
    except CallStopped:
        end_stopped_call(pipe)
        raise
    except ParallelError as e:  # --parallel: the ranks disagree or lost one another
        raise RunError(one_line(e)) from None
    except torch.OutOfMemoryError:
        raise RunError(
            f"out of memory generating {len(job.indices)} image(s) at {job.width}x{job.height}: "
            "use a smaller --resolution or --batch-size"
        ) from None
    except Exception as e:
        if cache is not None:
            raise RunError(f"{type(pipe).__name__} failed with --cache {cache}: {type(e).__name__}: "
                           f"{one_line(e)[:300]} (try without --cache)") from None  # fmt: skip
        if isinstance(e, (TypeError, ValueError)):  # a pipeline that needs more than a prompt (an input image...)
            raise RunError(f"{type(pipe).__name__} refused the call: {one_line(e)[:300]}") from None
        raise
    video = getattr(output, "images", None) is None and getattr(output, "frames", None) is not None
    pixels = output.frames if video else output.images
    non_finite = (
        f"the pipeline produced NaN or infinite pixels for {job.width}x{job.height} seed {job.seeds[0]}"
        f"{hint}; nothing was written for this call"
    )
    if not video and _stacked(pixels):  # a stack of layers per image
        layers = _layers(pipe, pixels, job, kwargs.get("output_type"), non_finite)
        return Pixels([stack[0] for stack in layers], layers=layers)
    if kwargs.get("output_type") not in ("np", "pt"):
        if video:
            videos = [list(frames) for frames in pixels]
            return Pixels([frames[0] for frames in videos], videos)
        return Pixels(list(pixels))
    if isinstance(pixels, torch.Tensor):  # output_type="pt": an image pipeline's decoded batch, on its device
        if video or pixels.ndim != 4 or not pixels.is_floating_point():
            raise RunError(f"{type(pipe).__name__} returned a {pixels.dtype} tensor of shape {tuple(pixels.shape)} "
                           "for output_type='pt', not a batch of images (N, C, H, W)")  # fmt: skip
        found = check_pixels(pixels)  # one reduction and one sync, on the device
        if not found.finite:
            raise RunError(non_finite)
        # diffusers' numpy_to_pil of its "np" output, bit for bit, from a quarter of the bytes.
        return Pixels(to_pil_images(pixels, found))
    array = np.asarray(pixels)  # output_type="np", or a pipeline that gives numpy whatever it is asked
    if not np.isfinite(array).all():
        raise RunError(non_finite)
    from diffusers.image_processor import VaeImageProcessor

    if not video:
        return Pixels(VaeImageProcessor.numpy_to_pil(array))
    videos = [VaeImageProcessor.numpy_to_pil(frames) for frames in array]  # (videos, frames, H, W, C)
    return Pixels([frames[0] for frames in videos], videos)


def _stacked(pixels: Any) -> bool:
    """Whether a call's ``images`` are a list of per-image stacks: tensors or arrays of 4 axes
    (layers, then an image's), or lists of PIL images, as a layered pipeline gives them."""
    if not isinstance(pixels, (list, tuple)) or not pixels:
        return False
    first = pixels[0]
    return isinstance(first, (list, tuple)) or getattr(first, "ndim", None) == 4


def _layers(pipe: Any, stacks: Any, job: Job, output_type: str | None, non_finite: str) -> list[list[Any]]:
    """A layered call's stacks as each image's layers (PIL, RGBA where the VAE made four channels).

    The stacks are joined first and cut again at ``len(job.indices)`` images: diffusers 0.42.1's
    Qwen-Image Layered cuts its decoded batch at ``layers + 1`` a stack, so with several images a
    call its stacks straddle images (its decoded batch itself is in order: image by image, each
    layer by layer). Checked like any image: non-finite pixels are a RunError.
    """
    import numpy as np
    import torch

    from accel import check_pixels, to_pil_images

    if output_type == "pt":
        batch = torch.cat([torch.as_tensor(s) for s in stacks])
        found = check_pixels(batch)
        if not found.finite:
            raise RunError(non_finite)
        flat = to_pil_images(batch, found)
    elif output_type == "np":
        array = np.concatenate([np.asarray(s) for s in stacks])
        if not np.isfinite(array).all():
            raise RunError(non_finite)
        from diffusers.image_processor import VaeImageProcessor

        flat = VaeImageProcessor.numpy_to_pil(array)
    else:  # PIL already
        flat = [layer for stack in stacks for layer in stack]
    n = len(job.indices)
    if not flat or len(flat) % n:
        raise RunError(f"{type(pipe).__name__} returned {len(flat)} layer image(s) for {n} image(s): "
                       "not a whole number of layers an image")  # fmt: skip
    per = len(flat) // n
    return [flat[i * per : (i + 1) * per] for i in range(n)]


def graph_replays(pipe: Any) -> int | None:
    """Replays of the denoisers' graphs so far, or None where the accelerator does not tell.

    The denoisers only (``accel.recipes``' components): a text encoder or decoder that replayed
    while the denoiser ran eagerly must not make the call read as ``bcg``."""
    try:
        accel = pipe.accel
        stats = accel.stats(memory=False)
        return sum(stats[name].replays for name in accel.recipes if name in stats)
    except Exception:  # an accel without stats() or recipes: what ran is then what was asked
        return None


def mode_ran(pipe: Any, mode: str, before: int | None) -> str:
    """What the denoiser did in the call just made: ``bcg`` only if a graph was replayed."""
    if mode != "bcg" or before is None:
        return mode
    after = graph_replays(pipe)
    return "bcg" if after is None or after > before else "eager"
