"""The library's float8 layers on the CPU (``torch._scaled_mm`` runs there too, the device check
lifted), and the one-pass SwiGLU quantization's calls counted: its CPU path is the tensor ops, run
from the op's own body whether the caller is compiled or not."""

from __future__ import annotations

import pytest

from accel.hooks.fp8 import row_quant, scaled_mm

__all__ = ["count_silu_mul"]


def count_silu_mul(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each call of the SwiGLU quantization, until ``monkeypatch``
    undoes it; float8 layers of the library's may be made on the CPU meanwhile."""
    calls: list[int] = []
    reference = row_quant.quantize_silu_mul_rows_reference
    monkeypatch.setattr(row_quant, "quantize_silu_mul_rows_reference", lambda g, u: calls.append(1) or reference(g, u))
    monkeypatch.setattr(scaled_mm, "check_fp8_device", lambda device, what="": None)
    return calls
