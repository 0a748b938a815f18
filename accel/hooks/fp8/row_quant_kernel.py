"""The Triton kernel of :func:`accel.hooks.fp8.row_quant.quantize_rows_e4m3` and
:func:`~accel.hooks.fp8.row_quant.quantize_silu_mul_rows_e4m3`, in a module of its own: Triton
resolves a kernel's names in its module's globals, and this one is imported only where the kernel
runs (CUDA with Triton), never at ``import accel``."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["quantize_rows_kernel"]


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    up_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_up,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    GELU_TANH: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row, the whole row in registers: read once, written once as e4m3, with its
    float32 scale.

    At these sizes the kernel is bound by its arithmetic, not its bytes (an H100, 4096 rows:
    scripts/device/probe_row_kernel.py): an IEEE division per value (``div_rn``) took 21 us for
    rows of 3072 where a copy of the bytes takes 10, libdevice's tanh doubled the GELU's time.
    So the division is a product with the row's reciprocal and one Newton correction (the
    correctly rounded quotient, bit for bit the tensor ops' in every value probed: 11 us), and the
    GELU's tanh is written with one exponential and its division is the fast one (97 us for rows
    of 12288 against 154 for inductor's kernel; 3 in 10,000 values one float8 step away from the
    two tensor ops).

    ``SILU_MUL`` quantizes ``silu(x) * up`` (a SwiGLU feed-forward's down-projection input) with
    both rounded to the input's dtype as the modules hand them on; ``up_ptr`` is read only then.
    The SiLU is inductor's (the compiled model's own): ``x * sigmoid(x)``, its exponential and
    division the fast ones. An IEEE division there made the kernel bound by its arithmetic, not
    its two rows' bytes (scripts/device/probe_swiglu_kernel.py).
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    raw = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    if GELU_TANH:
        # GELU(tanh) in float32, rounded to the input's dtype as the module would hand it on;
        # tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|), which never overflows.
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        e = tl.exp(-2.0 * tl.abs(inner))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(inner < 0, -t, t)
        x = (0.5 * x * (1.0 + t)).to(raw.dtype).to(tl.float32)
    if SILU_MUL:
        up = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (x * tl.sigmoid(x)).to(raw.dtype).to(tl.float32)
        x = (silu * up).to(raw.dtype).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # The scale in the input's dtype, as the tensor ops compute it on CUDA (a division by a number
    # is a product with its float32 reciprocal there), then widened.
    amax = tl.maximum(amax, FLOOR).to(raw.dtype).to(tl.float32)
    scale = (amax * INV_QMAX).to(raw.dtype).to(tl.float32)
    if GELU_TANH:
        q = x / scale
    else:
        r = tl.math.div_rn(1.0, scale)
        q0 = x * r
        q = tl.math.fma(tl.math.fma(-q0, scale, x), r, q0)
        q = tl.where(x == 0.0, x, q)  # the correction's sum turns -0 into +0; the division keeps it
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)
