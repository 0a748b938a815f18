"""The channel RMS norm of diffusers' causal video VAEs through inductor, for a ``compile=True``
pipeline's components (its VAE decoder).

Wan's VAE and those copied from it (Qwen-Image's, Qwen-Image 2.1's: diffusers' ``*RMS_norm``
classes of ``diffusers.models.autoencoders``) normalise over the channels with ``F.normalize`` in
float32, then scale, weight and shift: eagerly nine kernels, each a full pass over an activation
that at 1024x1024 holds 151M values, about 36 bytes moved per value where one pass moves 4.
:func:`compile_channel_norms` gives those modules a forward through one ``torch.compile`` of the
same expression (dynamic shapes: one compile serves every layer and resolution), which the
component's graphs capture like any kernel. Inductor rounds where the eager ops round (its
``emulate_precision_casts``), so only the channels' sum of squares may run in another order.

Recognised by what the module is, not its name alone: a class named ``*RMS_norm`` from diffusers'
autoencoders whose forward names what diffusers 0.42's does, channel-first, with ``scale``,
``gamma`` and ``bias`` as that code defines them, and no forward of its own. Anything else keeps its forward. Not guaranteed bit for bit the stock norm
(that sum's order): applied only with ``compile=True`` and ``compiled_forms``, whose rule is
graphs equal to the same compiled model without graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .compile import route_forwards

__all__ = ["compile_channel_norms", "is_channel_rms_norm"]

WHY = "the VAE's channel RMS norm through inductor (compile=True)"

# Where F.normalize runs in float32, as the stock forward decides.
_LOW = (torch.float16, torch.bfloat16)
# The globals and attributes diffusers 0.42's forward of these classes names, in its order: another
# forward (a later diffusers that computes otherwise) keeps its own.
_FORWARD_NAMES = (
    "dtype", "torch", "float16", "bfloat16", "any", "F", "normalize", "float", "channel_first", "to", "scale", "gamma", "bias",
)  # fmt: skip


def channel_rms_norm(rows: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The stock forward on ``rows`` (N, C, L) with ``gamma`` and ``bias`` as (C, 1): channels
    normalised to unit length (in float32 for half types), times ``scale`` and ``gamma``, plus ``bias``."""
    x = rows.float() if rows.dtype in _LOW else rows
    y = F.normalize(x, dim=1).to(rows.dtype) * scale * gamma
    return y if bias is None else y + bias


_compiled: Callable[..., torch.Tensor] | None = None


def _channel_rms_norm() -> Callable[..., torch.Tensor]:
    global _compiled
    if _compiled is None:  # one wrapper for the process: its compiled code serves every module
        # Rounded to the input's dtype after each product and the sum, as the eager ops round:
        # without it inductor keeps float32 through them and a quarter of the values move.
        _compiled = torch.compile(
            channel_rms_norm, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        )
    return _compiled


def is_channel_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of diffusers' VAE channel RMS norms this route reproduces."""
    cls = type(module)
    gamma, bias = getattr(module, "gamma", None), getattr(module, "bias", None)
    return (
        cls.__name__.endswith("RMS_norm")
        and cls.__module__.startswith("diffusers.models.autoencoders.")
        and getattr(getattr(cls.forward, "__code__", None), "co_names", None) == _FORWARD_NAMES
        and "forward" not in vars(module)
        and getattr(module, "channel_first", None) is True
        and isinstance(getattr(module, "scale", None), float)
        and isinstance(gamma, torch.nn.Parameter)
        and gamma.dim() >= 1
        and gamma.shape[1:].numel() == 1
        and (
            bias == 0.0
            if isinstance(bias, float)
            else isinstance(bias, torch.nn.Parameter) and bias.shape == gamma.shape
        )
    )


def _forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    stock = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Inductor's kernel has no backward here and helps only on the GPU.
        if not x.is_cuda or torch.is_grad_enabled() or x.dim() < 3 or x.dtype not in (*_LOW, torch.float32):
            return stock(module, x)
        return _as_rows(_channel_rms_norm(), x, module)

    return forward


def _as_rows(compiled: Callable[..., torch.Tensor], x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``compiled`` norm of ``x`` seen as ``(N, C, L)``: the same values (each position's channels
    are normalised on their own), one rank for every caller."""
    # Detached, never copied: dynamo takes a Parameter's shape as fixed (a compile per channel count).
    rows = x.reshape(x.shape[0], x.shape[1], -1).detach()
    gamma = module.gamma.detach().reshape(-1, 1)
    bias = None if isinstance(module.bias, float) else module.bias.detach().reshape(-1, 1)
    return compiled(rows, gamma, bias, module.scale).view(x.shape)


def compile_channel_norms(module: torch.nn.Module, cache_dir: Path | None = None) -> Callable[[], None] | None:
    """Route ``module``'s VAE channel RMS norms (:func:`is_channel_rms_norm`) through inductor until
    the returned undo is called; None where there are none. Compiles on first use, with the kernel
    cache in ``cache_dir`` (see :func:`accel.hooks.compiled.compile.use_compile_cache`)."""
    norms = [m for m in module.modules() if is_channel_rms_norm(m)]
    return route_forwards(module, norms, _forward, cache_dir, WHY, "channel RMS norms")
