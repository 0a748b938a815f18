"""Rotary embeddings in real arithmetic, for Qwen-Image's compiled blocks.

Qwen-Image rotates queries and keys as complex numbers: ``view_as_complex(x.float())`` times a
complex frequency table. Inductor has no complex kernels, so with ``compile=True`` every rotation
is a separate ATen kernel reading and writing fp32 (a few percent of a 1024x1024 step, plus the
RMS norm that feeds it writing fp32 instead of bf16). The same product written on the real
and imaginary parts, ``(a*c - b*d, a*d + b*c)`` in fp32, is one pointwise expression inductor
fuses into the norm before it and the cast after it.

Equal to diffusers' complex product in real arithmetic, and bit for bit on the CPU, but not
promised bit for bit on CUDA (a fused multiply-add may round once where the complex kernel rounds
twice): applied only with ``compile=True``, whose rule is graphs equal to the same compiled model
without graphs. The code it replaces is diffusers 0.42's (the recipe pins that range).

With the GELU epilogue of accel.hooks.compiled.fused it shortens Qwen-Image's 1024x1024 step
(measured: docs/benchmarks.md, "Measurements behind the code"). Qwen-Image 2.1's transformer rotates with its own copy
of the same helper, which gets the same form. Z-Image rotates the same way, inside a closure of
its attention processor; the same form there measured no change, so it is not applied.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from accel import patch, unpatched

__all__ = ["QWEN_MODULE", "qwen_rope_in_real_arithmetic", "rotate_pairs"]

WHY = "rotary embeddings in real arithmetic (compile=True)"


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x``'s last dimension read as (real, imaginary) pairs, times the complex ``freqs``
    (broadcast to the pairs), in fp32, returned in ``x``'s dtype: diffusers'
    ``view_as_real(view_as_complex(x.float()...) * freqs).flatten(-2).type_as(x)``, in real ops."""
    f = torch.view_as_real(freqs)
    cos, sin = f[..., 0], f[..., 1]
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return out.flatten(-2).type_as(x)


# -- Qwen-Image: the module-level helper its attention processor calls -----------------------------
QWEN_MODULE = "diffusers.models.transformers.transformer_qwenimage"


def qwen_rope_in_real_arithmetic(module: str = QWEN_MODULE) -> Callable[[], None]:
    """``apply_rotary_emb_qwen(..., use_real=False)`` of the diffusers ``module`` (Qwen-Image's by
    default; Qwen-Image 2.1's has its own copy) in real arithmetic until the returned undo is called
    (other uses of the helper run diffusers' code)."""
    mod = sys.modules[module]
    original = unpatched(mod, "apply_rotary_emb_qwen")

    def apply_rotary_emb_qwen(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1
    ) -> torch.Tensor:
        if use_real or not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
            return original(x, freqs_cis, use_real, use_real_unbind_dim)
        return rotate_pairs(x, freqs_cis.unsqueeze(1))  # diffusers: freqs_cis.unsqueeze(1)

    return patch(mod, "apply_rotary_emb_qwen", apply_rotary_emb_qwen, why=WHY).undo
