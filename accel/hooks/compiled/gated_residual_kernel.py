"""The Triton kernel of :func:`accel.hooks.compiled.gated_residual.gated_residual`, in a module of its
own (imported only where it runs: CUDA with Triton, never at ``import accel``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LAUNCH_OPTIONS", "TOKENS", "gated_residual_kernel"]

# The product is rounded to bf16 before the sum, as the tensor ops round it; no FMA across them.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Tokens a program holds: 8 of 1024 channels are 16 KiB of each input in flight.
TOKENS = 8


@triton.jit
def gated_residual_kernel(
    x_ptr,
    y_ptr,
    g_ptr,
    mask_ptr,
    out_ptr,
    N,
    SEQ,
    ROWS_BEFORE_LAST,
    D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    TOKENS: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    """``out = x + bf16(g[row] * y)`` over ``N`` tokens of ``D`` channels (contiguous), ``g`` the
    gate's rows already through tanh (bf16). A token's row is its sample's (``token // SEQ``); with
    ``HAS_MASK`` only where ``mask[token % SEQ]`` is set, the last row (``ROWS_BEFORE_LAST``) elsewhere."""
    tok = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    live = tok < N
    ch = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    row = tok // SEQ
    if HAS_MASK:
        own = tl.load(mask_ptr + tok % SEQ, mask=live, other=0) != 0
        row = tl.where(own, row, ROWS_BEFORE_LAST)
    m = live[:, None]
    at = tok[:, None] * D + ch[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + at, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row[:, None] * D + ch[None, :], mask=m, other=0.0).to(tl.float32)
    product = (g * y).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + at, (x + product).to(tl.bfloat16), mask=m)
