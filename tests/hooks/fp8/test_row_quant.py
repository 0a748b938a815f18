"""accel.hooks.fp8.row_quant on the CPU: the op's contract and its tensor-op path (the one-pass
Triton kernel runs on CUDA only: tests/cuda/test_fp8.py compares its bits with these)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from accel.hooks.fp8.row_quant import (
    E4M3_MAX,
    quantize_rows_e4m3,
    quantize_rows_reference,
    quantize_silu_mul_rows_e4m3,
)
from tests.helpers.traced import traced


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gelu", [False, True])
def test_off_cuda_the_op_is_the_tensor_ops(dtype: torch.dtype, gelu: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 48, generator=g).to(dtype) * 5
    x[3] = 0
    q, scale = quantize_rows_e4m3(x, gelu)
    want_q, want_scale = quantize_rows_reference(x, gelu)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (9, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    # What it computes: each row over its largest magnitude (after the GELU) times 448, a zero row zeros.
    y = F.gelu(x, approximate="tanh") if gelu else x
    # Within half an e4m3 step: 1/16 of a value, or of the smallest step (subnormals) of its row.
    assert ((q.float() * scale - y.float()).abs() <= y.float().abs() / 16 + scale * 2**-10).all()
    assert (q.float().abs().amax(dim=1)[[0, 1, 2, 4]] == E4M3_MAX).all() and not q[3].float().any()


def test_the_op_is_one_opaque_call_to_dynamo_and_takes_rows_only() -> None:
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    got, seen = traced(lambda t: quantize_rows_e4m3(t, True), x)
    want = quantize_rows_reference(x, True)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.ops.bcg_diffusers.quantize_rows_e4m3.default in seen
    with pytest.raises(ValueError, match=r"takes \(rows, K\), got shape \(2, 5, 32\)"):
        quantize_rows_e4m3(torch.randn(2, 5, 32))


def test_silu_mul_off_cuda_is_the_modules_arithmetic_then_the_rows_and_refuses_a_mismatch() -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(2, 7, 64, generator=g).to(torch.bfloat16) * 4).unbind(0)
    q, scale = quantize_silu_mul_rows_e4m3(gate, up)
    # Qwen-Image 2.1's feed-forward as diffusers writes it, then the rows' quantization.
    want_q, want_scale = quantize_rows_reference(torch.nn.SiLU()(gate) * up)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert not torch.equal(q.view(torch.uint8), quantize_rows_reference(F.silu(gate) * gate)[0].view(torch.uint8))
    with pytest.raises(ValueError, match=r"gate and up \(rows, K\) of one dtype, got \(7, 64\).*\(7, 32\)"):
        quantize_silu_mul_rows_e4m3(gate, up[:, :32])
    with pytest.raises(ValueError, match="of one dtype"):
        quantize_silu_mul_rows_e4m3(gate, up.float())
    got, seen = traced(quantize_silu_mul_rows_e4m3, gate, up)
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], scale)
    # One opaque call, its two results read from it, no ATen op.
    assert [t for t in seen if t is not operator.getitem] == [
        torch.ops.bcg_diffusers.quantize_silu_mul_rows_e4m3.default
    ]
