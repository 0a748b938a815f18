"""Per-head RMS norm and rotary product in one pass: :func:`head_norm_rope`.

Attention layers of the Qwen-Image family normalise each head of their queries and keys (an RMS
norm over the head's channels, diffusers' ``RMSNorm``) and then rotate them (the complex rotary
product, in real arithmetic under ``compile=True``:
:func:`pipelines.families.qwen_image.forms.rotate_pairs` is its model). Inductor compiles that to
a reduction kernel per tensor; with the keys of a K/V cache it also writes the rotated keys out
and copies them again behind the cached prefix. On an H100 those kernels took 5.5 ms of Qwen-Image
2.1's 77.5 ms float8 step at 1024x1024, about three times what their bytes take (docs/benchmarks.md).

:func:`head_norm_rope` is one custom op, opaque to dynamo and inductor: on CUDA a Triton program
holds a block of head rows in registers, reads each once and writes the rotated row (behind a
copied prefix where one is given: the cached keys' concatenation); elsewhere it is
:func:`head_norm_rope_reference`, the modules' tensor ops. The kernel rounds where the modules
round (the norm's output, the weight's product, the rotation), so only the norm's sum runs in
another order: a value now and then one bf16 unit away (tests/cuda/test_head_norm.py bounds how
far and how often). Used by a recipe's compiled form only, under ``compile=True``, whose rule is
graphs equal to the same compiled model without graphs. It does not take float16, a norm without
weight or a weight of another dtype than the input's: those take the reference.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["head_norm_rope", "head_norm_rope_reference"]

# Head sizes the kernel holds (a power of two: the row is split into its (real, imaginary) pairs).
_HEAD_DIMS = (64, 128, 256)


def head_norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, prefix: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` (batch, tokens, heads, D) through diffusers' ``RMSNorm(D)`` with ``weight`` (D), in
    ``x``'s dtype (as Qwen-Image 2.1's attention casts it), then each (real, imaginary) pair of
    channels times ``freqs`` (tokens, D / 2, 2: the complex frequencies as ``torch.view_as_real``
    gives them) in float32, rounded to ``x``'s dtype; behind ``prefix`` (batch, P, heads, D) along
    the tokens where given."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    y = (y * weight).to(x.dtype)
    real, imag = y.float().reshape(*y.shape[:-1], -1, 2).unbind(-1)
    cos, sin = freqs[:, None, :, 0], freqs[:, None, :, 1]
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).to(x.dtype)
    return out if prefix is None else torch.cat([prefix, out], dim=1)


def _check(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, prefix: torch.Tensor | None) -> None:
    ok = (
        x.dim() == 4
        and weight.shape == (x.shape[-1],)
        and x.shape[-1] % 2 == 0
        and freqs.shape == (x.shape[1], x.shape[-1] // 2, 2)
        and not freqs.is_complex()
        and (
            prefix is None or (prefix.dim() == 4 and prefix.shape[0] == x.shape[0] and prefix.shape[2:] == x.shape[2:])
        )
    )
    if not ok:
        raise ValueError(
            "head_norm_rope takes x (batch, tokens, heads, D), weight (D), freqs (tokens, D / 2, 2) real and "
            f"prefix (batch, P, heads, D) or None; got {tuple(x.shape)}, {tuple(weight.shape)}, "
            f"{tuple(freqs.shape)} {freqs.dtype}, {None if prefix is None else tuple(prefix.shape)}"
        )


def _one_pass(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, prefix: torch.Tensor | None) -> bool:
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == x.dtype
        and freqs.dtype == torch.float32
        and x.shape[-1] in _HEAD_DIMS
        and x.stride(-1) == 1
        and (prefix is None or prefix.dtype == x.dtype)
    )


@torch.library.custom_op("bcg_diffusers::head_norm_rope", mutates_args=())
def head_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, prefix: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`head_norm_rope_reference` in one pass on CUDA (see the module docstring)."""
    _check(x, weight, freqs, prefix)
    if not _one_pass(x, weight, freqs, prefix):
        return head_norm_rope_reference(x, weight, eps, freqs, prefix)
    from .head_norm_kernel import head_norm_rope_kernel

    with torch.cuda.device(x.device):
        return launch(head_norm_rope_kernel, x, weight, eps, freqs, prefix)


def launch(
    kernel: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``kernel`` (:func:`~accel.hooks.compiled.head_norm_kernel.head_norm_rope_kernel`, or the
    same function under Triton's interpreter) as the op does; the prefix is copied by ATen."""
    import triton

    from .head_norm_kernel import LAUNCH_OPTIONS, ROWS

    batch, tokens, heads, d = x.shape
    p = 0 if prefix is None else prefix.shape[1]
    out = torch.empty((batch, p + tokens, heads, d), dtype=x.dtype, device=x.device)
    if p:
        out[:, :p].copy_(prefix)
    n = batch * tokens * heads
    if n:
        freqs = freqs.contiguous()
        kernel[(triton.cdiv(n, ROWS),)](
            x,
            weight.contiguous(),
            freqs,
            out,
            n,
            tokens,
            heads,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            out.stride(0),
            p,
            EPS=float(eps),
            HALF=d // 2,
            ROWS=ROWS,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return out


@head_norm_rope.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, prefix: torch.Tensor | None = None
) -> torch.Tensor:
    p = 0 if prefix is None else prefix.shape[1]
    return x.new_empty((x.shape[0], p + x.shape[1], x.shape[2], x.shape[3]))
