"""The Triton kernel of :func:`accel.hooks.fp8.norm_quant.modulated_norm_rows_e4m3`, in a module of
its own (imported only where it runs: CUDA with Triton, never at ``import accel``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LAUNCH_OPTIONS", "modulated_norm_rows_kernel"]

# Triton lets LLVM contract a product and the sum after it into one FMA unless told not to. Here
# that merged the modulation's product and its shift, both narrowed to bf16 arithmetic
# (``fma.rn.bf16x2`` on sm_90), into one rounding where the modules round twice: on an H100 4% of
# the float8 values differed from the reference and 22% of the rows' scales
# (samples/gpu-run-2026-12-06e/9-kern.log), as the same arithmetic rounded once does on the CPU
# (tests/hooks/fp8/test_norm_quant_kernel.py). The Newton correction's FMAs are written out, so
# nothing else here wants contraction.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def modulated_norm_rows_kernel(
    x_ptr,
    shift_ptr,
    scale_ptr,
    rows_ptr,
    q_ptr,
    s_ptr,
    K,
    ROWS_PER_SAMPLE,
    stride_x,
    stride_mod,
    EPS: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row, the whole row in registers: its LayerNorm (no affine), the sample's
    modulation ``norm * (1 + scale) + shift``, each step rounded to the input's dtype as the
    modules compute it eagerly (launched with :data:`LAUNCH_OPTIONS`, which keep those roundings
    apart), then its float8 values and scale as the row kernel of
    :mod:`accel.hooks.fp8.row_quant_kernel` computes them. The row is read once; the modulated
    activation is never written out. Only the norm's statistics differ from ATen's LayerNorm
    (another order of the sums, Welford's there), which moves a bf16 norm value by one unit in a
    few in 100,000.

    Without ``HAS_SHIFT`` the modulation is ``norm * (1 + scale)`` (Qwen-Image 2.1's). With
    ``HAS_ROWS`` each row reads the modulation row ``rows_ptr`` names for it (Qwen-Image 2.1's
    condition tokens take the last, ``t = 0`` row), else its sample's."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        sample = tl.load(rows_ptr + row).to(tl.int64)
    else:
        sample = row // ROWS_PER_SAMPLE
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    raw = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    # Correctly rounded divisions (Triton's ``/`` is the approximate one): two per row.
    mean = tl.math.div_rn(tl.sum(x, axis=0), tl.cast(K, tl.float32))
    centered = tl.where(mask, x - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, axis=0), tl.cast(K, tl.float32))
    norm = (centered * tl.math.rsqrt(var + EPS)).to(raw.dtype).to(tl.float32)
    scale_mod = tl.load(scale_ptr + sample * stride_mod + offs, mask=mask, other=0.0).to(tl.float32)
    one_plus = (1.0 + scale_mod).to(raw.dtype).to(tl.float32)
    y = (norm * one_plus).to(raw.dtype).to(tl.float32)
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + sample * stride_mod + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y + shift).to(raw.dtype).to(tl.float32)
    y = tl.where(mask, y, 0.0)
    amax = tl.max(tl.abs(y), axis=0)
    amax = tl.maximum(amax, FLOOR).to(raw.dtype).to(tl.float32)
    scale = (amax * INV_QMAX).to(raw.dtype).to(tl.float32)
    r = tl.math.div_rn(1.0, scale)
    q0 = y * r
    q = tl.math.fma(tl.math.fma(-q0, scale, y), r, q0)
    q = tl.where(y == 0.0, y, q)  # the correction's sum turns -0 into +0; the division keeps it
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)
