"""The Triton kernel of :func:`accel.hooks.fp8.row_quant.quantize_rows_e4m3`, in a module of its
own: Triton resolves a kernel's names in its module's globals, and this one is imported only where
the kernel runs (CUDA with Triton), never at ``import accel``."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["quantize_rows_kernel"]


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row, the whole row in registers: read once, written once as e4m3, with its
    float32 scale."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    raw = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    if GELU_TANH:
        # ATen's CUDA GELU(tanh) in float32, then rounded to the input's dtype as the module would
        # hand it on.
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        x = (0.5 * x * (1.0 + libdevice.tanh(inner))).to(raw.dtype).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # The scale in the input's dtype, as the tensor ops compute it on CUDA (a division by a number
    # is a product with its float32 reciprocal there), then widened.
    amax = tl.maximum(amax, FLOOR).to(raw.dtype).to(tl.float32)
    scale = (amax * INV_QMAX).to(raw.dtype).to(tl.float32)
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)
