"""The per-row quantization's Triton kernel (accel/hooks/fp8/row_quant_kernel.py) under Triton's
interpreter on the CPU, against the tensor ops it stands for (skipped without Triton:
docs/development.md; tests/helpers/interpreted.py says how the interpreter is made to round as
the GPU does). Three forms: plain rows, rows after a GELU(tanh), and ``silu(gate) * up``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from accel.hooks.fp8 import row_quant
from accel.hooks.fp8.row_quant import quantize_rows_reference, quantize_silu_mul_rows_reference
from tests.helpers.interpreted import apart, faithful, run_child

try:
    import triton  # noqa: F401

    from accel.hooks.fp8.row_quant_kernel import quantize_rows_kernel
except ImportError:  # the CPU environment leaves Triton out (docs/development.md)
    quantize_rows_kernel = None

needs_triton = pytest.mark.skipif(quantize_rows_kernel is None, reason="needs Triton (docs/development.md says how)")

# Rows of Qwen-Image's and Qwen-Image 2.1's widths (fewer of them: a row's program does not depend
# on how many there are), and one narrow row whose block is wider than it.
SHAPES = [(5, 48), (3, 3072), (2, 12288)]


def _rows(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    x[0, : shape[1] // 2] = 0  # a half-zero row; the scale is still the other half's
    x[-1, :3] = -0.0  # negative zeros stay negative, as the tensor ops' division keeps them
    return x


def _interpret() -> dict[str, Any]:
    """In the child: each form under the interpreter against its reference, per shape."""
    from triton.runtime import interpreter

    assert isinstance(quantize_rows_kernel, interpreter.InterpretedFunction)
    out: dict[str, Any] = {}
    with faithful():
        for shape in SHAPES:
            x, up = _rows(shape, 0), _rows(shape, 1)
            name = "x".join(map(str, shape))
            out[f"plain {name}"] = apart(*row_quant.launch(quantize_rows_kernel, x), *quantize_rows_reference(x))
            got = row_quant.launch(quantize_rows_kernel, x, gelu_tanh=True)
            out[f"gelu {name}"] = apart(*got, *quantize_rows_reference(x, True))
            got = row_quant.launch(quantize_rows_kernel, x, up=up)
            out[f"silu_mul {name}"] = apart(*got, *quantize_silu_mul_rows_reference(x, up))
            # The kernel reads up, not x twice: against x's own square it must differ.
            out[f"silu_mul against silu(x) * x {name}"] = apart(*got, *quantize_silu_mul_rows_reference(x, x))
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_child("tests.hooks.fp8.test_row_quant_kernel")


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_plain_rows_and_silu_mul_are_the_tensor_ops_bit_for_bit(interpreted, shape: tuple[int, int]) -> None:
    name = "x".join(map(str, shape))
    assert interpreted[f"plain {name}"] == [0.0, 0.0]
    # The SiLU's quotient is correctly rounded and each step rounded to bf16 as the modules do; the
    # interpreter's exponential is numpy's (the GPU's fast one may move a value in some 10,000).
    assert interpreted[f"silu_mul {name}"] == [0.0, 0.0]
    assert interpreted[f"silu_mul against silu(x) * x {name}"][0] > 0.5


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_gelu_form_is_within_its_stated_rate(interpreted, shape: tuple[int, int]) -> None:
    # Its tanh from one exponential and its fast division: a few values in 10,000 one step away.
    differ, scales = interpreted[f"gelu {'x'.join(map(str, shape))}"]
    assert differ < 1e-3 and scales < 0.5


if __name__ == "__main__":
    print(json.dumps(_interpret()))
