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
families  the families' configs, geometry and inputs as data: one module per family
registry  :data:`FAMILIES`, :func:`family`
construct the pipeline, its denoiser, VAE and scheduler, parameter counts
inputs    random, seeded embeddings and call keywords
"""

from __future__ import annotations

from ..lazy import lazy_exports
from .names import NAMES

# Loaded on first use: the names alone import neither torch nor diffusers.
__getattr__, __dir__, _LAZY = lazy_exports(
    __name__,
    {
        "construct": (
            "absent_components",
            "build",
            "build_component",
            "build_scheduler",
            "parameter_counts",
        ),
        "spec": ("SIZES", "Embedding", "Family", "Geometry"),
        "inputs": ("call_inputs", "call_kwargs", "embeddings"),
        "registry": ("FAMILIES", "family"),
    },
)

__all__ = ["NAMES", *_LAZY]
