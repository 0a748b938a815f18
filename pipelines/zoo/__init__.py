"""A zoo of diffusers pipelines at their released denoiser configs, for breadth benchmarks.

Sixteen families (:data:`NAMES`): FLUX.1-dev, FLUX.2-dev, SD3.5 Large, SDXL, Wan2.1 14B and 1.3B,
LTX-Video, HunyuanVideo, HunyuanVideo-1.5, Sana 1600M, PixArt-Sigma, Chroma1-HD, CogView4,
HiDream-I1, Lumina-Image-2.0 and Qwen-Image-Edit. Each is built with random weights and no text
encoders; calls pass random prompt embeddings of the shapes those encoders produce::

    pipe = zoo.build("sd3", "full", device="cuda", dtype=torch.bfloat16)
    kwargs = zoo.call_kwargs("sd3", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    latents = pipe(**kwargs, output_type="latent").images

``"full"`` is the release's denoiser and VAE (their parameter counts are the released models');
``"tiny"`` keeps the structure at a few layers and narrow widths, seconds on a CPU.

The modules, one job each:

names     :data:`NAMES` (imports nothing)
spec      :class:`Family`, :class:`Geometry`, :class:`Embedding`: what the zoo knows of one family
images    the text-to-image and edit families' configs
videos    the text-to-video families' configs
registry  :data:`FAMILIES`, :func:`family`
construct the pipeline, its denoiser, VAE and scheduler, parameter counts
inputs    random, seeded embeddings and call keywords
"""

from __future__ import annotations

import importlib
from typing import Any

from .names import NAMES

# Loaded on first use (PEP 562): the names alone import neither torch nor diffusers.
_NAMES = {
    "construct": ("absent_components", "build", "build_denoiser", "build_scheduler", "build_vae", "parameter_counts"),
    "spec": ("SIZES", "Embedding", "Family", "Geometry"),
    "inputs": ("call_inputs", "call_kwargs", "embeddings"),
    "registry": ("FAMILIES", "family"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = ["NAMES", *sorted(_MODULE_OF)]
