"""A modulated LayerNorm that writes its float8 activation and row scales: :func:`modulated_norm_rows_e4m3`.

Qwen-Image's image stream normalises each block's residual (LayerNorm, no affine), modulates it
per sample (``norm * (1 + scale) + shift``) and hands it to float8 products, whose one-pass
quantization (:mod:`accel.hooks.fp8.row_quant`) reads it again: the modulated activation is
written out in bf16 only to be read once more (on an H100 the norms of Qwen-Image's float8 step
rose from 13.5 to 23.0 ms when its quantization became a separate pass;
samples/gpu-run-2026-12-06d/). :func:`modulated_norm_rows_e4m3` does the norm, the modulation and
the quantization in one op: on CUDA one Triton program per row holds the row in registers, reads
it once and writes only the float8 values and the row's scale
(:mod:`accel.hooks.fp8.norm_quant_kernel`); elsewhere (and for rows too long for registers) it is
:func:`modulated_norm_rows_reference`, the modules' own operations followed by the tensor ops of
the row quantization, bit for bit what the unfused path computes eagerly. The kernel rounds each
step to the input's dtype as the modules do (launched without LLVM's contraction, which on an H100
had merged the modulation's product and shift into one rounding: 4% of the values off); its sums
run in another order than ATen's LayerNorm, so a few values land one float8 step away
(tests/cuda/test_fused_quant.py bounds how far and how often; on the CPU
tests/hooks/fp8/test_norm_quant_kernel.py reads its PTX for sm_90 and runs it under Triton's
interpreter; the CUDA test passes on an H100, samples/gpu-run-2026-12-06f/). Used by a recipe's
compiled form only, opted in until its speed in a full step is measured (Qwen-Image:
``QwenImageRecipe.fused_norm_fp8``,
``pipelines/families/qwen_image/fused_norms.py``), under ``compile=True``, whose rule is graphs
equal to the same compiled model without graphs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .row_quant import E4M3, MAX_ROW, kernel_constants, quantize_rows_reference

__all__ = ["modulated_norm_rows_e4m3", "modulated_norm_rows_reference"]


def modulated_norm_rows_reference(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor, eps: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (batch, tokens, K) LayerNorm-ed over K without affine, modulated by ``shift`` and
    ``scale`` (M, K) as diffusers' Qwen-Image block does (``norm * (1 + scale) + shift``; Qwen-Image
    2.1's has no shift: None), then as float8 rows (batch * tokens, K) and their float32 scales
    (batch * tokens, 1). Each sample's tokens take its own modulation row (M = batch), or, given
    ``rows`` (batch * tokens integers), each token the row it names."""
    batch, tokens, k = x.shape
    y = F.layer_norm(x, (k,), eps=eps)

    def per_token(m: torch.Tensor) -> torch.Tensor:
        return m.unsqueeze(1) if rows is None else m[rows].view(batch, tokens, k)

    y = y * (1 + per_token(scale))
    if shift is not None:
        y = y + per_token(shift)
    return quantize_rows_reference(y.reshape(-1, k))


def _one_pass(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.shape[-1] <= MAX_ROW and x.is_contiguous()


@torch.library.custom_op("bcg_diffusers::modulated_norm_rows_e4m3", mutates_args=())
def modulated_norm_rows_e4m3(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor, eps: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulated_norm_rows_reference` in one pass on CUDA (see the module docstring)."""
    batch, tokens, k = x.shape if x.dim() == 3 else (0, 0, -1)
    m = scale.shape[0] if scale.dim() == 2 else -1
    if (
        x.dim() != 3
        or scale.shape != (m, k)
        or (shift is not None and shift.shape != scale.shape)
        or (rows is None and m != batch)
        or (rows is not None and (rows.shape != (batch * tokens,) or rows.is_floating_point()))
    ):
        raise ValueError(
            f"modulated_norm_rows_e4m3 takes x (batch, tokens, K), shift (or None) and scale (M, K), and rows "
            f"(batch * tokens integers, or None where M is batch); got {tuple(x.shape)}, "
            f"{None if shift is None else tuple(shift.shape)}, {tuple(scale.shape)}, "
            f"{None if rows is None else tuple(rows.shape)}"
        )
    if not _one_pass(x) or scale.dtype != x.dtype or (shift is not None and shift.dtype != x.dtype):
        return modulated_norm_rows_reference(x, shift, scale, eps, rows)
    from .norm_quant_kernel import modulated_norm_rows_kernel

    with torch.cuda.device(x.device):
        return launch(modulated_norm_rows_kernel, x, shift, scale, eps, rows)


def launch(
    kernel: Any,
    x: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` (:func:`~accel.hooks.fp8.norm_quant_kernel.modulated_norm_rows_kernel`, or
    the same function under Triton's interpreter) over the rows of ``x`` as the op does: one
    program per row, with :data:`~accel.hooks.fp8.norm_quant_kernel.LAUNCH_OPTIONS`."""
    import triton

    from .norm_quant_kernel import LAUNCH_OPTIONS

    batch, tokens, k = x.shape
    n = batch * tokens
    has_shift = shift is not None
    scale = scale.contiguous()
    shift = shift.contiguous() if has_shift else scale  # read only with HAS_SHIFT
    q = torch.empty((n, k), dtype=E4M3, device=x.device)
    s = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        block = triton.next_power_of_2(k)
        kernel[(n,)](
            x,
            shift,
            scale,
            s if rows is None else rows.contiguous(),  # read only with HAS_ROWS
            q,
            s,
            k,
            tokens,
            k,
            k,
            EPS=float(eps),
            **kernel_constants(x.dtype),
            HAS_SHIFT=has_shift,
            HAS_ROWS=rows is not None,
            BLOCK=block,
            num_warps=4 if block <= 4096 else 8,
            **LAUNCH_OPTIONS,
        )
    return q, s


@modulated_norm_rows_e4m3.register_fake
def _(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor, eps: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0] * x.shape[1]
    return x.new_empty((rows, x.shape[2]), dtype=E4M3), x.new_empty((rows, 1), dtype=torch.float32)
