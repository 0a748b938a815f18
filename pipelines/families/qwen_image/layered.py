"""Qwen-Image Layered: ``QwenImageLayeredPipeline`` (diffusers 0.42), an image split into RGBA layers.

Its denoiser is Qwen-Image's (``use_layer3d_rope`` and ``use_additional_t_cond`` set), so the
Qwen-Image recipe (:mod:`pipelines.families.qwen_image.recipe`) serves it; this module holds what its call needs:

* **No size arguments.** The call takes an image (RGBA where the VAE reads four channels) and a
  ``resolution`` (640 or 1024), and makes ``layers`` layers (4 by default) at
  :func:`output_size`: the resolution's area at the image's aspect ratio. A warm-up resolution
  is therefore the *input image's* size, as for the edit pipelines, and the calls it captures
  are those of images of that size at the ``resolution`` and ``layers`` in ``call_kwargs``.
* **A prompt is passed.** An empty prompt makes the pipeline caption the image with its text
  encoder's ``generate`` (hundreds of eager calls), and a call with embeddings but no prompt
  counts as empty: the warm-up passes both.
* **No latent output.** ``output_type="latent"`` ends in an ``UnboundLocalError`` in 0.42 (the
  latents are never named ``images``), so the warm-up decodes (``"pt"``).
* **Text is never padded.** Every call has at least three frames of the resolution's area
  (layers + 1 generated, one condition) , far above the image size up to which Qwen-Image's text
  buckets pay: the text keeps its exact length, bit for bit with the stock pipeline, and the
  prompts real calls will use are warmed up by ``prompts=[...]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = [
    "RESOLUTIONS",
    "check_warmup",
    "in_vae_mode",
    "is_layered",
    "is_layered_pipeline",
    "output_size",
    "resolution_of",
    "warmup_call",
]

# The resolutions QwenImageLayeredPipeline accepts (it asserts one of them).
RESOLUTIONS = (640, 1024)
# What the warm-up decodes to: "latent" fails in diffusers 0.42 (see the module docstring).
WARMUP_OUTPUT_TYPE = "pt"


def is_layered(module: torch.nn.Module) -> bool:
    """Whether a Qwen-Image denoiser is the Layered one (its layer-indexed RoPE)."""
    return bool(getattr(getattr(module, "config", None), "use_layer3d_rope", False))


def is_layered_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` is called as ``QwenImageLayeredPipeline`` (``layers`` and ``resolution``)."""
    params = inspect.signature(pipe.__call__).parameters
    return "layers" in params and "resolution" in params


def _default(pipe: Any, name: str) -> Any:
    return inspect.signature(pipe.__call__).parameters[name].default


def resolution_of(pipe: Any, call_kwargs: Mapping[str, Any]) -> Any:
    """The ``resolution`` the calls use: ``call_kwargs``' or the pipeline's default."""
    return call_kwargs.get("resolution", _default(pipe, "resolution"))


def check_warmup(pipe: Any, call_kwargs: Mapping[str, Any]) -> None:
    """ValueError, in one line, for a ``resolution`` or ``layers`` the pipeline cannot run."""
    resolution = resolution_of(pipe, call_kwargs)
    if resolution not in RESOLUTIONS:
        raise ValueError(
            f"qwen-image-layered: resolution must be {' or '.join(map(str, RESOLUTIONS))}, got {resolution!r}"
        )
    layers = call_kwargs.get("layers", _default(pipe, "layers"))
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"qwen-image-layered: layers must be a positive integer, got {layers!r}")


def output_size(width: int, height: int, resolution: int, multiple: int = 16) -> tuple[int, int]:
    """The layers' (width, height) for an input image of ``width`` x ``height``: the pipeline's own
    rule (``calculate_dimensions``: ``resolution``'s area at the image's aspect ratio), cut to a
    multiple of ``multiple`` (its VAE scale factor times 2)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_layered import calculate_dimensions

    w, h = calculate_dimensions(resolution * resolution, width / height)
    return w // multiple * multiple, h // multiple * multiple


def in_vae_mode(pipe: Any, image: Any) -> Any:
    """``image`` (a PIL image) in the mode the pipeline's VAE reads: RGBA for a four-channel VAE,
    as the released one is."""
    channels = getattr(getattr(getattr(pipe, "vae", None), "config", None), "input_channels", 3)
    return image.convert("RGBA") if channels == 4 and image.mode != "RGBA" else image


def warmup_call(
    pipe: Any, *, width: int, height: int, batch_size: int, prompt: str, call_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """What one Layered warm-up call passes besides text embeddings and guidance: a random image
    of the case's size in the VAE's mode (unless ``call_kwargs`` give one; its content changes no
    shape), one prompt per image, the decoded output."""
    out: dict[str, Any] = dict(prompt=[prompt] * batch_size, output_type=WARMUP_OUTPUT_TYPE)
    if "image" not in call_kwargs:
        pixels = np.random.default_rng(0).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        out["image"] = in_vae_mode(pipe, Image.fromarray(pixels))
    return out
