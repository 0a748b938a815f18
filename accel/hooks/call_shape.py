"""How a diffusers pipeline is called, read from its ``__call__`` signature and its components.

The generic warm-up (:class:`accel.hooks.recipes.generic.GenericRecipe`) drives pipelines nobody
wrote a recipe for; :func:`read_call_shape` tells it what a call of this pipeline looks like, so
that the warm-up makes the calls real calls make. Nothing here names a pipeline class: each rule reads
what the pipeline says of itself (checked against diffusers 0.42).

* **Guidance**, first rule that applies:

  - ``true_cfg_scale`` in the signature: *true CFG* (FLUX.1, FLUX.1 Kontext, HunyuanVideo,
    Qwen-Image and its edit pipelines). It runs with a scale above 1 *and* a negative prompt
    (``do_true_cfg`` in those pipelines); off is 1.0. FLUX.1's and HunyuanVideo's denoisers also
    have a guidance embedding, but its scale reaches them as a tensor, which changes no call.
  - a denoiser whose config has ``guidance_embeds=True`` (``Flux2Pipeline``): *distilled*
    guidance only; no call runs a second branch, so ``cfg`` changes no call and one case is
    captured. (Chroma's denoiser has no guidance embedding: classic CFG, below.)
  - ``guidance_scale`` in the signature: *classic CFG*. Where the pipeline has the
    ``do_classifier_free_guidance`` property (SD3, SDXL, Wan, LTX, Sana, Chroma, CogView4,
    HiDream, Lumina2, FLUX.2 klein, Z-Image), it is asked, with 5.0 for on and 1.0 (else 0.0,
    Z-Image's threshold being 0) for off; without one (PixArt-Sigma decides
    ``guidance_scale > 1.0`` inline) the values are 5.0 and 1.0. A pipeline whose property stays
    off at 5.0 (a distilled klein, SDXL with a ``time_cond_proj_dim``) never runs CFG: one case.
  - a ``guider`` component (HunyuanVideo-1.5): the guider's own configuration decides, no call
    argument does: one case.
  - otherwise none: one case.

* **Text**: the pipeline *has text encoders* when a ``text_encoder*`` component is not None.
  Its prompt-embedding arguments are the signature's parameters naming ``prompt_embeds`` or a
  prompt's attention/embedding mask.
* **Video**: ``num_frames`` in the signature, with its default where that is a positive int.
* **Image**: the pipeline *needs an image* when ``image`` is in the signature and

  - it has no default (image-to-video: Wan, HunyuanVideo, HunyuanVideo-1.5 I2V), or
  - ``strength`` is there too (image-to-image and inpainting start from the image), or
  - the pipeline has a ``processor`` component: a vision-language processor, through which the
    text encoder reads the image with the prompt (Qwen-Image-Edit, which fails at
    ``image.size`` when called without one), unless the call's docstring says ``image`` is
    ``*optional*``, diffusers' mark of an argument a call runs without (Qwen-Image 2.1 makes an
    image from text alone and reads one only as a condition).

  A denoiser taking more input channels than the VAE's latents is no sign on its own: packed
  latents (FLUX, FLUX.2: 2x2 patches) make that true of text-to-image models. Where an image is
  optional (FLUX.2's references, FLUX.1 Kontext) the warm-up passes none; calls with one pass it
  in ``call_kwargs``, as they pass masks and control images.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from .components import DENOISER_NAMES

__all__ = [
    "CFG",
    "DISTILLED",
    "GUIDER",
    "NONE",
    "TRUE_CFG",
    "CallShape",
    "call_parameters",
    "read_call_shape",
    "warmup_image",
]

TRUE_CFG = "true_cfg"
DISTILLED = "distilled"
CFG = "cfg"
GUIDER = "guider"
NONE = "none"

# The scales a warm-up passes: 4.0 is the true-CFG scale diffusers' own examples use; 5.0 is
# above every classic threshold diffusers 0.42 has (1 or 0); off is the scale pipelines
# document as "no guidance", 0.0 where 1.0 still guides (a threshold of 0).
TRUE_CFG_ON = 4.0
CFG_ON = 5.0
CFG_OFF = (1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class CallShape:
    """How one pipeline is called (see the module docstring for each rule).

    Attributes:
        pipeline: the pipeline's class name, for messages.
        guidance: :data:`TRUE_CFG`, :data:`DISTILLED`, :data:`CFG`, :data:`GUIDER` or :data:`NONE`.
        cfg_on, cfg_off: the scale a warm-up passes with guidance on and off (the
            ``true_cfg_scale`` for true CFG, the ``guidance_scale`` for classic CFG); None where
            ``cfg`` changes no call.
        takes_frames: ``num_frames`` is in the signature.
        default_frames: its default, where a positive int.
        needs_image: a call needs an ``image``.
        takes_prompt, takes_negative_prompt: ``prompt`` / ``negative_prompt`` are in the signature.
        embedding_params: the prompt-embedding arguments the call takes, in signature order.
        has_text_encoders: a ``text_encoder*`` component is present.
        batch_param: ``num_images_per_prompt`` or ``num_videos_per_prompt``, whichever it takes.
        required_params: arguments without a default (``self`` and ``**kwargs`` aside).
    """

    pipeline: str
    guidance: str
    cfg_on: float | None
    cfg_off: float | None
    takes_frames: bool
    default_frames: int | None
    needs_image: bool
    takes_prompt: bool
    takes_negative_prompt: bool
    embedding_params: tuple[str, ...]
    has_text_encoders: bool
    batch_param: str | None
    required_params: tuple[str, ...]

    @property
    def cfg_changes_calls(self) -> bool:
        """Whether guidance on and off make different calls (else one warm-up case covers both)."""
        return self.cfg_on is not None

    @property
    def negative_embedding_params(self) -> tuple[str, ...]:
        return tuple(p for p in self.embedding_params if p.startswith("negative_"))

    @property
    def positive_embedding_params(self) -> tuple[str, ...]:
        return tuple(p for p in self.embedding_params if not p.startswith("negative_"))

    def gives_text(self, call_kwargs: Mapping[str, Any]) -> bool:
        """Whether ``call_kwargs`` carry the prompt as embeddings (a mask or a pooled vector alone
        does not)."""
        return any(call_kwargs.get(p) is not None for p in self.positive_embedding_params if _is_sequence_param(p))

    def gives_negative(self, call_kwargs: Mapping[str, Any]) -> bool:
        """Whether ``call_kwargs`` carry the negative prompt as embeddings."""
        return any(call_kwargs.get(p) is not None for p in self.negative_embedding_params if _is_sequence_param(p))


def call_parameters(pipe: Any) -> Mapping[str, inspect.Parameter]:
    """The parameters of ``pipe``'s ``__call__`` (bound: no ``self``)."""
    return inspect.signature(pipe.__call__).parameters


def _is_embedding_param(name: str) -> bool:
    return "prompt_embeds" in name or ("prompt" in name and "mask" in name)


def _is_sequence_param(name: str) -> bool:
    """An embedding argument carrying the text itself (not its mask or a pooled vector)."""
    return "prompt_embeds" in name and "mask" not in name and "pooled" not in name


def _denoiser_config(components: Mapping[str, Any]) -> Mapping[str, Any]:
    for name in DENOISER_NAMES:
        module = components.get(name)
        if module is not None:
            return getattr(module, "config", None) or {}
    return {}


def _asks_cfg(pipe: Any, prop: property, scale: float) -> bool | None:
    """What the pipeline's ``do_classifier_free_guidance`` says at ``scale`` (None: it cannot say
    outside a call). The scale is set where ``__call__`` sets it and put back after."""
    missing = object()
    before = pipe.__dict__.get("_guidance_scale", missing)
    pipe.__dict__["_guidance_scale"] = scale
    try:
        return bool(prop.fget(pipe))
    except Exception:  # a property reading state only a call sets up
        return None
    finally:
        if before is missing:
            del pipe.__dict__["_guidance_scale"]
        else:
            pipe.__dict__["_guidance_scale"] = before


def _classic_scales(pipe: Any) -> tuple[float | None, float | None]:
    prop = getattr(type(pipe), "do_classifier_free_guidance", None)
    if not isinstance(prop, property) or prop.fget is None:
        return CFG_ON, CFG_OFF[0]
    on = _asks_cfg(pipe, prop, CFG_ON)
    if on is None:
        return CFG_ON, CFG_OFF[0]
    if not on:
        return None, None
    off = next((v for v in CFG_OFF if _asks_cfg(pipe, prop, v) is False), None)
    return (CFG_ON, off) if off is not None else (None, None)


def _guidance(pipe: Any, params: Mapping[str, inspect.Parameter], components: Mapping[str, Any]) -> tuple:
    if "true_cfg_scale" in params:
        return TRUE_CFG, TRUE_CFG_ON, 1.0
    if _denoiser_config(components).get("guidance_embeds"):
        return DISTILLED, None, None
    if "guidance_scale" in params:
        on, off = _classic_scales(pipe)
        return (CFG, on, off) if on is not None else (NONE, None, None)
    if components.get("guider") is not None:
        return GUIDER, None, None
    return NONE, None, None


# How diffusers' docstrings document an argument: "    image (`PipelineImageInput`, *optional*):".
_DOCUMENTED_IMAGE = re.compile(r"^\s*image \((.*)\):", re.MULTILINE)


def _documented_optional(pipe: Any) -> bool:
    """Whether ``pipe``'s ``__call__`` docstring marks ``image`` as ``*optional*``."""
    found = _DOCUMENTED_IMAGE.search(inspect.getdoc(type(pipe).__call__) or "")
    return found is not None and "*optional*" in found.group(1)


def _needs_image(pipe: Any, params: Mapping[str, inspect.Parameter], components: Mapping[str, Any]) -> bool:
    image = params.get("image")
    if image is None:
        return False
    if image.default is inspect.Parameter.empty or "strength" in params:
        return True
    return components.get("processor") is not None and not _documented_optional(pipe)


def read_call_shape(pipe: Any) -> CallShape:
    """How ``pipe`` (a diffusers pipeline) is called."""
    params = call_parameters(pipe)
    components = dict(pipe.components)
    guidance, cfg_on, cfg_off = _guidance(pipe, params, components)
    frames = params.get("num_frames")
    default_frames = frames.default if frames is not None else None
    if isinstance(default_frames, bool) or not isinstance(default_frames, int) or default_frames < 1:
        default_frames = None
    batch = next((p for p in ("num_images_per_prompt", "num_videos_per_prompt") if p in params), None)
    required = tuple(
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    return CallShape(
        pipeline=type(pipe).__name__,
        guidance=guidance,
        cfg_on=cfg_on,
        cfg_off=cfg_off,
        takes_frames=frames is not None,
        default_frames=default_frames,
        needs_image=_needs_image(pipe, params, components),
        takes_prompt="prompt" in params,
        takes_negative_prompt="negative_prompt" in params,
        embedding_params=tuple(p for p in params if _is_embedding_param(p)),
        has_text_encoders=any(v is not None for k, v in components.items() if k.startswith("text_encoder")),
        batch_param=batch,
        required_params=required,
    )


def warmup_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image of ``width`` x ``height``: what a warm-up call passes as ``image``
    (its content changes no shape; its size sets the shapes of image-conditioned calls)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
