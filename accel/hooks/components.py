"""The parts of a diffusers pipeline the library accelerates, found by their component names.

Denoisers are the components named :data:`DENOISER_NAMES`; besides them, the text encoders
(:data:`TEXT_ENCODER_NAMES`) and the VAE's decoder (:data:`VAE_DECODER`, a dotted path) get graphs
of their own. Nothing here names a model: these are the names diffusers' pipelines give their
components. Everything that looks a part up by name (the install plan, the generic warm-up's
reading of a pipeline's call) reads it here.
"""

from __future__ import annotations

from typing import Any

import torch

from .options import AcceleratorOptions

__all__ = [
    "DENOISER_NAMES",
    "TEXT_ENCODER_NAMES",
    "VAE_DECODER",
    "component",
    "components",
    "module_device",
]

DENOISER_NAMES = ("transformer", "transformer_2", "unet")
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
VAE_DECODER = "vae.decoder"


def component(pipe: Any, name: str) -> torch.nn.Module | None:
    """The module at a dotted component path (``"vae.decoder"``), if there is one."""
    obj = pipe
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.nn.Module) else None


def components(pipe: Any, options: AcceleratorOptions) -> list[str]:
    """Names of the non-denoiser modules that get graphs under ``options``."""
    names = list(TEXT_ENCODER_NAMES) if options.text_encoder else []
    if options.vae:
        names.append(VAE_DECODER)
    return [n for n in names if component(pipe, n) is not None]


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of the module's first parameter (CPU for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
