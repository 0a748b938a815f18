"""Variants of the one-pass float8 row quantization kernel (accel/hooks/fp8/row_quant_kernel.py):
how the division and the GELU's tanh are computed, and the warps per row, timed on this GPU and
compared bit for bit with the tensor ops (accel.hooks.fp8.row_quant.quantize_rows_reference).

    python3 scripts/device/probe_row_kernel.py --out out/probe-row-kernel.json

Each time is the median of CUDA-graph replays of 20 back-to-back calls, beside a copy of the
same bytes and the library's own op.
"""

# ruff: noqa: B023  (every closure is timed where it is made)
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.language.extra import libdevice

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import graph_ms


@triton.jit
def variant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    FLOOR: tl.constexpr,
    DIV: tl.constexpr,
    TANH: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    raw = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        if TANH == 0:
            t = libdevice.tanh(inner)
        else:
            e = tl.exp(-2.0 * tl.abs(inner))
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(inner < 0, -t, t)
        x = (0.5 * x * (1.0 + t)).to(raw.dtype).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR).to(raw.dtype).to(tl.float32)
    scale = (amax * 0.002232142857142857).to(raw.dtype).to(tl.float32)
    if DIV == 0:
        q = tl.math.div_rn(x, scale)
    elif DIV == 1:
        q = x / scale
    else:
        r = tl.math.div_rn(1.0, scale)
        q0 = x * r
        q = tl.math.fma(tl.math.fma(-q0, scale, x), r, q0)  # one Newton correction
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    import torch

    from accel.hooks.fp8 import quantize_rows_e4m3, quantize_rows_reference

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    rows_out = []
    for rows, k, gelu in ((4096, 3072, False), (4096, 12288, True), (4096, 12288, False), (66, 3072, False)):
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g) * 3
        ref_q, ref_s = quantize_rows_reference(x, gelu)
        src = torch.empty(rows * k * 3 // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        row = {"rows": rows, "k": k, "gelu": gelu, "copy_ms": graph_ms(lambda: dst.copy_(src))}
        row["library_ms"] = graph_ms(lambda: quantize_rows_e4m3(x, gelu))
        q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        s = torch.empty(rows, 1, device=dev, dtype=torch.float32)
        block = triton.next_power_of_2(k)
        for div in (0, 1, 2):
            for tanh in (0, 1) if gelu else (0,):
                for warps in (4, 8, 16, 32):
                    if block // (32 * warps) < 1:
                        continue

                    def call():
                        variant_kernel[(rows,)](
                            x, q, s, k, FLOOR=1e-12, DIV=div, TANH=tanh, GELU=gelu, BLOCK=block, num_warps=warps
                        )

                    name = f"div{div}_tanh{tanh}_w{warps}"
                    try:
                        row[name + "_ms"] = graph_ms(call)
                        call()
                        row[name + "_differ"] = int((q.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
                        row[name + "_scales_equal"] = bool(torch.equal(s, ref_s))
                    except Exception as e:
                        row[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
