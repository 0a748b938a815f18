"""Triton kernels run by Triton's interpreter on the CPU, as the GPU would round.

Triton picks the interpreter when a function is decorated (its own library's functions too, at its
import), so a kernel runs under it in a child process started with ``TRITON_INTERPRET=1``:
:func:`run_child` runs a test module as that child and reads the JSON line it prints. The
interpreter's own float conversions are not the GPU's (it truncates float32 to bf16 and rounds
float8 half up); :func:`faithful` swaps them for torch's, which round to nearest even as the
GPU's ``cvt.rn`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["apart", "faithful", "run_child"]

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn}
_BITS = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}


@contextlib.contextmanager
def faithful(on: bool = True) -> Iterator[None]:
    """Inside, the interpreter converts between float32, bf16 and e4m3 rounding to nearest even
    (torch's conversions); any other pair, or with ``on`` False, as the interpreter has it."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def conversion(data: np.ndarray, src: Any, dst: Any, rounding: Any) -> np.ndarray:
        nearest = (None, interpreter._ir.ROUNDING_MODE.RTNE)
        if str(src) not in _TORCH or str(dst) not in _TORCH or rounding not in nearest:
            return convert(data, src, dst, rounding)
        np_in, _ = _BITS[src.primitive_bitwidth]
        _, torch_out = _BITS[dst.primitive_bitwidth]
        bits = torch.from_numpy(np.ascontiguousarray(data).view(np_in).copy())
        out = bits.view(_TORCH[str(src)]).to(_TORCH[str(dst)]).view(torch_out).numpy()
        return out.view(getattr(np, f"uint{dst.primitive_bitwidth}")).reshape(data.shape)

    if on:
        interpreter._convert_float = conversion
    try:
        yield
    finally:
        interpreter._convert_float = convert


def apart(q: torch.Tensor, s: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor) -> tuple[float, float]:
    """The share of float8 values that differ, and of rows whose scale does."""
    assert q.shape == want_q.shape and s.shape == want_s.shape
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item()
    return differ, (s != want_s).float().mean().item()


def run_child(module: str) -> Any:
    """Run ``python -m module`` under the interpreter from the repository root; what its last line
    printed, as JSON."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", module],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
