"""The Triton kernel of :func:`accel.hooks.compiled.head_norm.head_norm_rope`, in a module of its own
(imported only where it runs: CUDA with Triton, never at ``import accel``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LAUNCH_OPTIONS", "ROWS", "head_norm_rope_kernel"]

# The modules round each product and difference of the rotation on its own; without this LLVM
# would merge a product and the difference after it into one FMA (one rounding).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Head rows per program: 32 rows of 128 bf16 channels are 8 KiB in flight per program.
ROWS = 32


@triton.jit
def head_norm_rope_kernel(
    x_ptr,
    w_ptr,
    f_ptr,
    out_ptr,
    N,
    TOKENS,
    HEADS,
    stride_xb,
    stride_xt,
    stride_xh,
    stride_ob,
    PREFIX,
    EPS: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``ROWS`` head rows a program (row ``r`` is sample ``r // (TOKENS * HEADS)``, token
    ``r // HEADS % TOKENS``, head ``r % HEADS``), each of ``2 * HALF`` channels read once as its
    (real, imaginary) pairs: the RMS norm in float32, rounded to bf16, times the weight rounded to
    bf16, then rotated by the token's frequencies (``f_ptr``: tokens x HALF x (cos, sin), float32)
    and written at token ``PREFIX + token`` of the contiguous output."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < N
    head = rows % HEADS
    token = (rows // HEADS) % TOKENS
    sample = rows // (HEADS * TOKENS)
    mask = live[:, None]

    chan = tl.arange(0, 2 * HALF)
    src = x_ptr + (sample * stride_xb + token * stride_xt + head * stride_xh)[:, None] + chan[None, :]
    row = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    re, im = tl.split(tl.reshape(row, (ROWS, HALF, 2)))
    variance = tl.sum(row * row, axis=1) / (2 * HALF)
    inv = tl.math.rsqrt(variance + EPS)[:, None]
    w_re, w_im = tl.split(tl.reshape(tl.load(w_ptr + chan).to(tl.float32), (HALF, 2)))
    w_re, w_im = w_re[None, :], w_im[None, :]
    # RMSNorm: the normalised row in bf16, then times the bf16 weight (a bf16 product).
    re = ((re * inv).to(tl.bfloat16).to(tl.float32) * w_re).to(tl.bfloat16).to(tl.float32)
    im = ((im * inv).to(tl.bfloat16).to(tl.float32) * w_im).to(tl.bfloat16).to(tl.float32)

    freq = tl.load(f_ptr + (token * (2 * HALF))[:, None] + chan[None, :], mask=mask, other=0.0)
    cos, sin = tl.split(tl.reshape(freq, (ROWS, HALF, 2)))
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos

    out = tl.reshape(tl.join(out_re, out_im), (ROWS, 2 * HALF))
    dst = out_ptr + (sample * stride_ob + (PREFIX + token) * (HEADS * 2 * HALF) + head * (2 * HALF))[:, None]
    tl.store(dst + chan[None, :], out.to(tl.bfloat16), mask=mask)
