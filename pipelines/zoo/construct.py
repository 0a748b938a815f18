"""Construct a zoo family's pipeline with random weights and no text encoders.

Weights are created in place on the target device and dtype (:func:`pipelines.construction.seeded`),
so a 32B denoiser on a GPU builds in seconds; on the ``meta`` device nothing is allocated,
which is how parameter counts are taken. As ``from_pretrained`` does, modules a denoiser class
names in ``_keep_in_fp32_modules`` stay in float32 under a half-precision dtype.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import diffusers
import torch
from diffusers import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..construction import as_dtype, seeded
from .registry import family
from .spec import Family, check_size

__all__ = ["absent_components", "build", "build_component", "build_scheduler", "parameter_counts"]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def _keep_fp32(module: torch.nn.Module, dtype: torch.dtype) -> None:
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    if dtype not in _HALF or not keep:
        return
    # Matched per parameter name, as from_pretrained matches them (a name part equal to an entry).
    with torch.no_grad():
        for name, param in module.named_parameters():
            if any(k in name.split(".") for k in keep):
                param.data = param.data.to(torch.float32)


def build_component(
    name: str,
    component: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The denoiser (``component`` its pipeline name: ``fam.denoiser``, "transformer" or "unet") or
    the ``"vae"`` of family ``name`` at ``size`` with random weights (``device="meta"``: no storage)."""
    fam, dtype = family(name), as_dtype(dtype)
    if component == fam.denoiser:
        class_name, config = fam.denoiser_class, fam.denoiser_config(check_size(size))
    elif component == "vae":
        class_name, config = fam.vae_class, fam.vae_config(check_size(size))
    else:
        raise ValueError(f"the zoo builds {name!r}'s {fam.denoiser!r} and 'vae', not {component!r}")
    cls = getattr(diffusers, class_name)
    module = seeded(lambda: cls(**config), device, dtype, seed)
    _keep_fp32(module, dtype)
    return module


def build_scheduler(name: str) -> SchedulerMixin:
    """The released scheduler of family ``name`` (no weights, so no size)."""
    fam = family(name)
    return getattr(diffusers, fam.scheduler_class)(**fam.scheduler_config())


def absent_components(fam: Family) -> list[str]:
    """The pipeline's constructor arguments the zoo passes as None (text encoders, tokenizers,
    processors, image encoders): every one without a default that the family does not build."""
    built = {fam.denoiser, "vae", "scheduler", *fam.components, *fam.pipeline_kwargs}
    params = inspect.signature(getattr(diffusers, fam.pipeline).__init__).parameters
    return [
        k
        for k, p in params.items()
        if k != "self" and k not in built and p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
    ]


def build(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> DiffusionPipeline:
    """The pipeline of family ``name`` at ``size`` on ``device`` in ``dtype``, random weights
    seeded with ``seed``, its text encoders and tokenizers None (calls pass embeddings: see
    :func:`pipelines.zoo.call_kwargs`). In eval mode, progress bars off."""
    fam, dtype = family(name), as_dtype(dtype)
    check_size(size)
    start = time.perf_counter()
    parts: dict[str, Any] = {
        **{c: build_component(name, c, size, device, dtype, seed) for c in (fam.denoiser, "vae")},
        "scheduler": build_scheduler(name),
        **{k: getattr(diffusers, cls)(**kwargs) for k, (cls, kwargs) in fam.components.items()},
        **fam.pipeline_kwargs,
    }
    parts.update(dict.fromkeys(absent_components(fam)))
    pipe = getattr(diffusers, fam.pipeline)(**parts)
    for attr, value in fam.attributes.get(size, {}).items():
        setattr(pipe, attr, value)
    # Parts are already in `dtype`; only tensors made outside the construction context move.
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    logger.info("built %s (%s, %s) in %.1f s", fam.pipeline, name, size, time.perf_counter() - start)
    return pipe


def parameter_counts(name: str, size: str = "full") -> dict[str, int]:
    """Parameters of the denoiser and the VAE of family ``name`` at ``size``, by component name,
    counted on the ``meta`` device (nothing allocated)."""
    fam = family(name)
    modules = {c: build_component(name, c, size, "meta") for c in (fam.denoiser, "vae")}
    return {k: sum(p.numel() for p in m.parameters()) for k, m in modules.items()}
