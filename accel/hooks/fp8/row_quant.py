"""Per-row float8 quantization of activations in one pass: :func:`quantize_rows_e4m3`, :func:`quantize_silu_mul_rows_e4m3`.

A float8 product's input is quantized per row: its largest magnitude, a scale from it, then every
value divided, clamped and cast to e4m3. Written as tensor ops, inductor compiles that to a
reduction kernel that reads each row twice, and fuses in whatever produced the input (a GELU, a
norm); on an H100 such kernels took 34.7 ms of Qwen-Image's 213 ms float8 step at 1024x1024,
about 2.5 times what their bytes take (samples/gpu-run-2026-12-06b/profile-q-fp8/, probed alone
in scripts/device/probe_quant.py: 4096 rows of 3072, 23.7 us against 10.5 for one pass; after a
GELU, 4096 rows of 12288, 154 us against 93.5).

:func:`quantize_rows_e4m3` is one custom op, opaque to dynamo and inductor like
:func:`~accel.hooks.fp8.scaled_mm.scaled_mm_rowwise`: on CUDA one Triton program per row keeps
the row in registers, so it is read once; elsewhere (and for rows too long for registers) it is
:func:`quantize_rows_reference`, the tensor ops. Both give the same bits: the scale is computed
in the input's dtype as ATen does, each quotient is correctly rounded, the cast rounds to nearest
even (tests/cuda/test_fp8.py, every dtype). ``gelu_tanh=True`` quantizes
``gelu(x, approximate="tanh")`` rounded to ``x``'s dtype, as diffusers' GELU module would hand it
on, without writing it out: equal to the two ops in real arithmetic, with a faster tanh and
division that leave a few values in 10,000 one float8 step away from them. A feed-forward hands
it the GELU only with ``compile=True`` (:mod:`accel.hooks.compiled.fused`), whose rule is graphs
equal to the same compiled model without graphs.

:func:`quantize_silu_mul_rows_e4m3` does the same for a SwiGLU feed-forward's down projection
(Qwen-Image 2.1's ``out(silu(gate_layer(x)) * proj(x))``): it reads the two up projections' rows
and quantizes ``silu(gate) * up`` without writing the product out. Inductor's kernel for those
ops, the product and its quantization, read each row twice: 163 us of Qwen-Image 2.1's float8
step per block on an H100 at 1024x1024 (samples/gpu-run-2026-12-07c/h100-2/profile-q21/).
Its SiLU is inductor's ``x * sigmoid(x)``, as the compiled model's own; handed it only with
``compile=True`` (the family's compiled forms).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .quantizers import ZERO_ROW_FLOOR

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "MAX_ROW",
    "kernel_constants",
    "launch",
    "quantize_rows_e4m3",
    "quantize_rows_reference",
    "quantize_silu_mul_rows_e4m3",
    "quantize_silu_mul_rows_reference",
    "row_floor",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
# 1 / 448 as a float32, the factor ATen's CUDA division by 448 multiplies with.
_INV_QMAX = float(torch.tensor(1 / E4M3_MAX, dtype=torch.float32))
# Longest row one program holds in registers (16 warps, 32 values a thread); longer rows take
# the tensor ops.
MAX_ROW = 16384
# float16 rows take the tensor ops: one float16 case of tests/cuda/test_fp8.py gave other bits on an
# H100, and no supported model runs float8 from float16.
_DTYPES = (torch.bfloat16, torch.float32)


def quantize_rows_reference(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., K) as e4m3 values and float32 scales (..., 1), one scale per row: its largest
    magnitude (never below :func:`row_floor`, so zeros stay zeros) over :data:`E4M3_MAX`;
    after ``gelu(x, approximate="tanh")`` if asked. The same operations, in the same dtypes, as
    torchao's per-row float8 (the scale is computed in ``x``'s dtype, then widened), so both
    quantizers give the same bits; :func:`quantize_rows_e4m3` computes them in one pass."""
    if gelu_tanh:
        x = F.gelu(x, approximate="tanh")
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=row_floor(x.dtype))
    scale = (amax / E4M3_MAX).float()
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def row_floor(dtype: torch.dtype) -> float:
    """The least scale numerator: :data:`ZERO_ROW_FLOOR`, or the dtype's smallest normal number
    where that rounds to zero in it (float16), which would turn a row of zeros into 0 / 0."""
    return max(ZERO_ROW_FLOOR, torch.finfo(dtype).tiny)


def kernel_constants(dtype: torch.dtype) -> dict[str, float]:
    """The quantization's constants as the one-pass kernels take them: the scale's floor for
    ``dtype``, e4m3's largest value and its float32 reciprocal."""
    return dict(FLOOR=row_floor(dtype), QMAX=E4M3_MAX, INV_QMAX=_INV_QMAX)


def _one_pass(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _DTYPES and 0 < x.shape[-1] <= MAX_ROW and x.stride(-1) == 1


@torch.library.custom_op("bcg_diffusers::quantize_rows_e4m3", mutates_args=())
def quantize_rows_e4m3(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, K) as e4m3 values (rows, K) and float32 scales (rows, 1), one per row: its
    largest magnitude (never below :func:`row_floor`, so zeros stay zeros) over 448, computed in
    ``x``'s dtype. With ``gelu_tanh``, of ``gelu(x, approximate="tanh")``. One pass on CUDA."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_e4m3 takes (rows, K), got shape {tuple(x.shape)}")
    if not _one_pass(x):
        return quantize_rows_reference(x, gelu_tanh)
    from .row_quant_kernel import quantize_rows_kernel

    with torch.cuda.device(x.device):
        return launch(quantize_rows_kernel, x, gelu_tanh=gelu_tanh)


def quantize_silu_mul_rows_reference(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` quantized per row as :func:`quantize_rows_reference` does: the input of
    a SwiGLU feed-forward's down projection, with the SiLU and the product each in the inputs'
    dtype, as the modules compute them."""
    return quantize_rows_reference(F.silu(gate) * up)


@torch.library.custom_op("bcg_diffusers::quantize_silu_mul_rows_e4m3", mutates_args=())
def quantize_silu_mul_rows_e4m3(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_silu_mul_rows_reference`: ``silu(gate) * up`` (rows, K) as e4m3 rows and
    their float32 scales, without writing the product out. One pass on CUDA, where the SiLU is
    inductor's ``x * sigmoid(x)`` (a compiled model's own): a few values in 10,000 land one float8
    step from the tensor ops."""
    if gate.dim() != 2 or up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(
            f"quantize_silu_mul_rows_e4m3 takes gate and up (rows, K) of one dtype, got {tuple(gate.shape)} "
            f"{gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if not (_one_pass(gate) and _one_pass(up)):
        return quantize_silu_mul_rows_reference(gate, up)
    from .row_quant_kernel import quantize_rows_kernel

    with torch.cuda.device(gate.device):
        return launch(quantize_rows_kernel, gate, up=up)


def launch(
    kernel: Any, x: torch.Tensor, up: torch.Tensor | None = None, gelu_tanh: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` (:func:`~accel.hooks.fp8.row_quant_kernel.quantize_rows_kernel`, or the same
    function under Triton's interpreter) over the rows of ``x`` as the ops do: one program per row;
    with ``up``, of ``silu(x) * up``."""
    import triton

    rows, k = x.shape
    q = torch.empty((rows, k), dtype=E4M3, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(k)
        # Measured best on an H100 (scripts/device/probe_row_kernel.py, probe_swiglu_kernel.py):
        # the GELU's arithmetic wants more warps per row than the plain quantization's bytes do,
        # and the SwiGLU's two rows more still.
        if block <= 8192:
            warps = 4 if block <= 4096 else 8
        else:
            warps = 32 if up is not None else 16 if gelu_tanh else 8
        kernel[(rows,)](
            x,
            x if up is None else up,
            q,
            scale,
            k,
            x.stride(0),
            x.stride(0) if up is None else up.stride(0),
            **kernel_constants(x.dtype),
            GELU_TANH=gelu_tanh,
            SILU_MUL=up is not None,
            BLOCK=block,
            num_warps=warps,
        )
    return q, scale


@quantize_rows_e4m3.register_fake
def _(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@quantize_silu_mul_rows_e4m3.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape, dtype=E4M3), gate.new_empty((gate.shape[0], 1), dtype=torch.float32)
