"""Offline builders for Qwen-Image, Z-Image, FLUX.1 and Wan2.1 pipelines with random weights.

Two sizes of each embedded model:

* ``"tiny"``: a few layers and narrow widths, built in seconds on a CPU. Used by the CPU tests and
  as the CLI's default, where only the structure of the denoising loop matters.
* ``"full"``: the released models' shapes (Qwen-Image 20B with a Qwen2.5-VL-7B text encoder,
  Z-Image 6B with a Qwen3-4B text encoder, FLUX.1-dev 12B with CLIP-L and T5-XXL, Wan2.1-T2V 14B
  or 1.3B with UMT5-XXL), for GPU benchmarks. The weights are random, so the images are noise,
  but every kernel has its real size and count.

Only widths and depths differ between the sizes; the structural choices the pipelines depend on
(VAE scale factor 8, 16 latent channels, patch sizes, Qwen-Image's 34-token system prefix, FLUX's
guidance embedding, Wan's causal video VAE, the text encoder families) are those of the real
checkpoints. Nothing is downloaded: the tokenizers are made in-process (see
:mod:`pipelines.tokenizer` and :mod:`pipelines.tokenizers_t5_clip`).

The models' classes and configs are data, one module per family
(``pipelines/families/<family>/release.py``, read through :mod:`pipelines.releases`); this module
builds them (seeded random weights, created in place: :mod:`pipelines.construction`) and refuses
full-size weights that cannot fit the device (:func:`pipelines.limits.check_weights`). Which
models exist is the catalog's answer (:mod:`pipelines.families.catalog`).

Any other name is handed to ``DiffusionPipeline.from_pretrained`` (a local folder or a hub id),
so callers can use one entry point for random and real weights::

    pipe = build_pipeline("z-image", size="full", device="cuda", dtype=torch.bfloat16)
    pipe = build_pipeline("Tongyi-MAI/Z-Image-Turbo", device="cuda", dtype=torch.bfloat16)
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from transformers import PreTrainedTokenizerBase

from . import limits
from .construction import as_dtype, seeded
from .releases.configs import (
    ALIASES,
    MODEL_NAMES,
    SIZES,
    build_tokenizers,
    canonical_name,
    check_size,
    constructor,
    pipeline_class,
    release,
    require_model,
    scheduler_config,
)

__all__ = [
    "SIZES",
    "build_modules",
    "build_pipeline",
    "build_scheduler",
    "build_text_encoder",
    "build_transformer",
    "build_vae",
    "canonical_name",
    "describe",
    "pipeline_class",
]

logger = logging.getLogger(__name__)

# A hub repo id is "org/name" with exactly one slash; anything else that is not an existing folder
# is a typo, and from_pretrained's own error for it (a failed download) would hide that.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------
def build_transformer(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The denoiser of ``name`` with random weights (``device="meta"`` builds no storage)."""
    model = require_model(name)
    transformer = seeded(constructor(model, "transformer", size), device, dtype, seed)
    redrawn = release(model).redrawn
    if redrawn:
        with torch.no_grad():
            for attr in redrawn:
                getattr(transformer, attr).normal_()
    return transformer


def build_vae(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The VAE of ``name`` with random weights."""
    return seeded(constructor(name, "vae", size), device, dtype, seed)


def build_text_encoder(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    component: str = "text_encoder",
) -> torch.nn.Module:
    """A text encoder of ``name`` with random weights: the first (Qwen2.5-VL, Qwen3, CLIP-L or
    UMT5), or ``component="text_encoder_2"``, FLUX.1's second (T5-XXL's encoder; ValueError for a
    model without one)."""
    return seeded(constructor(name, component, size, tokenizer), device, dtype, seed)


def build_scheduler(name: str) -> SchedulerMixin:
    """The released scheduler of ``name`` (no weights, so no size)."""
    return release(name).scheduler_class(**scheduler_config(name))


def build_modules(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizers: dict[str, PreTrainedTokenizerBase] | None = None,
) -> dict[str, torch.nn.Module]:
    """Every component of ``name`` that has weights, by pipeline component name, each seeded with
    ``seed`` on its own (``device="meta"`` builds no storage, to count bytes)."""
    model = require_model(name)
    toks = tokenizers if tokenizers is not None else build_tokenizers(model)
    kwargs: dict[str, Any] = dict(size=size, device=device, dtype=dtype, seed=seed)
    modules = dict(
        transformer=build_transformer(model, **kwargs),
        vae=build_vae(model, **kwargs),
        text_encoder=build_text_encoder(model, tokenizer=toks["tokenizer"], **kwargs),
    )
    if "tokenizer_2" in toks:
        modules["text_encoder_2"] = build_text_encoder(
            model, tokenizer=toks["tokenizer_2"], component="text_encoder_2", **kwargs
        )
    for component in release(model).image_encoders:
        modules[component] = seeded(constructor(model, component, size), device, dtype, seed)
    return modules


# --------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------
def _build_embedded(
    model: str, size: str, device: str | torch.device, dtype: torch.dtype, seed: int
) -> DiffusionPipeline:
    limits.check_weights(model, size, device, dtype)  # before anything is allocated
    tokenizers = build_tokenizers(model)
    modules = build_modules(model, size=size, device=device, dtype=dtype, seed=seed, tokenizers=tokenizers)
    data = release(model)
    settings = dict(data.pipeline_kwargs)
    # A pipeline reading its prompt through a processor takes it in place of the tokenizer.
    text = {"processor": data.processor(tokenizers["tokenizer"], size)} if data.processor else tokenizers
    # An image-reading pipeline's image processors, and the components an offline build leaves out.
    images = {name: cls(**kwargs) for name, (cls, kwargs) in data.image_processors.items()}
    images.update(dict.fromkeys(data.absent))
    pipe = pipeline_class(model)(**modules, **text, **images, scheduler=build_scheduler(model), **settings)
    # Components are already in `dtype`: casting again would turn the fp32 rotary buffers that
    # transformers keeps on purpose (and from_pretrained leaves alone) into low precision. Only
    # the device move remains, for the few tensors created outside the construction context.
    return pipe.to(device)


def build_pipeline(
    name: str | os.PathLike[str],
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> DiffusionPipeline:
    """Build a pipeline by name.

    ``name`` is an embedded model (one of :data:`MODEL_NAMES` or an alias such as "zimage",
    "flux.1", "wan2.1"), built offline with random weights at ``size`` ("tiny" or "full") and seeded
    with ``seed``; or a local pipeline folder or hub id, loaded with ``from_pretrained`` (``size``
    and ``seed`` do not apply). The pipeline is in eval mode on ``device`` in ``dtype``.

    An embedded model whose weights do not fit ``device``'s free memory raises
    :class:`pipelines.limits.LimitError` (a ValueError) before anything is allocated.
    """
    check_size(size)
    dtype = as_dtype(dtype)
    name = os.fspath(name)
    model = canonical_name(name)
    start = time.perf_counter()
    if model is not None:
        pipe = _build_embedded(model, size, device, dtype, seed)
        source = f"{model} ({size}, random weights, seed {seed})"
    elif os.path.isdir(name) or _HUB_ID.match(name):
        # `dtype`, not `torch_dtype`: diffusers 0.42 deprecates the latter with a warning.
        pipe = DiffusionPipeline.from_pretrained(name, dtype=dtype).to(device)
        source = name
    else:
        aliases = sorted(a for a in ALIASES if a not in MODEL_NAMES)
        raise ValueError(
            f"unknown model {name!r}: expected one of {', '.join(map(repr, MODEL_NAMES))} "
            f"(aliases: {', '.join(aliases)}), an existing pipeline folder, "
            f"or a Hugging Face hub id like 'org/name'"
        )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    logger.info("built %s from %s in %.1f s", describe(pipe), source, time.perf_counter() - start)
    return pipe


def _format_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.2f}M"


def describe(pipe: DiffusionPipeline) -> str:
    """One line naming the pipeline and its denoiser's size.

    For example "ZImagePipeline (transformer 0.59M params)".
    """
    for attr in ("transformer", "unet"):
        denoiser = getattr(pipe, attr, None)
        if isinstance(denoiser, torch.nn.Module):
            n = sum(p.numel() for p in denoiser.parameters())
            return f"{type(pipe).__name__} ({attr} {_format_count(n)} params)"
    return type(pipe).__name__
