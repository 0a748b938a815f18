"""Forms of the one-pass SwiGLU float8 quantization (``silu(gate) * up`` per row,
accel/hooks/fp8/row_quant_kernel.py) and the warps per row, timed on this GPU at Qwen-Image 2.1's
shape (4096 rows of 12288), beside a copy of the kernel's bytes, the library's op and the plain
rows of 4096 (the attention output's quantization); each form's values that
differ from the tensor ops (accel.hooks.fp8.row_quant.quantize_silu_mul_rows_reference).

    python3 scripts/device/probe_swiglu_kernel.py --out out/probe-swiglu.json

SILU 0: ``div_rn(x, 1 + exp(-x))`` (an IEEE division per value), 1: ``x * sigmoid(x)``
(inductor's form), 2: ``x / (1 + exp(-x))`` (the fast division). Times: medians of CUDA-graph
replays of 20 back-to-back calls.
"""

# ruff: noqa: B023  (every closure is timed where it is made)
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import graph_ms


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, q_ptr, s_ptr, K, SILU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    raw = tl.load(g_ptr + row * K + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    up = tl.load(u_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    if SILU == 0:
        silu = tl.math.div_rn(x, 1.0 + tl.exp(-x))
    elif SILU == 1:
        silu = x * tl.sigmoid(x)
    else:
        silu = x / (1.0 + tl.exp(-x))
    x = (silu.to(raw.dtype).to(tl.float32) * up).to(raw.dtype).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12).to(raw.dtype).to(tl.float32)
    scale = (amax * 0.002232142857142857).to(raw.dtype).to(tl.float32)
    r = tl.math.div_rn(1.0, scale)
    q0 = x * r
    q = tl.math.fma(tl.math.fma(-q0, scale, x), r, q0)
    q = tl.where(x == 0.0, x, q)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    import torch

    from accel.hooks.fp8 import row_quant

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    rows, k = 4096, 12288
    gate = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g) * 3
    up = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g) * 3
    ref_q, _ = row_quant.quantize_silu_mul_rows_reference(gate, up)
    src = torch.empty(rows * k * 5, dtype=torch.uint8, device=dev)  # two bf16 rows in, e4m3 out
    dst = torch.empty_like(src)
    out: dict = {"device": torch.cuda.get_device_name(dev), "rows": rows, "k": k}
    out["copy_same_bytes_ms"] = graph_ms(lambda: dst[: rows * k * 5 // 2].copy_(src[: rows * k * 5 // 2]))
    out["library_ms"] = graph_ms(lambda: row_quant.quantize_silu_mul_rows_e4m3(gate, up))
    lq, _ = row_quant.quantize_silu_mul_rows_e4m3(gate, up)
    out["library_differ"] = int((lq.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
    q = torch.empty_like(gate, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    for silu in (0, 1, 2):
        for warps in (8, 16, 32):

            def call():
                swiglu_kernel[(rows,)](gate, up, q, s, k, SILU=silu, BLOCK=16384, num_warps=warps)

            name = f"silu{silu}_w{warps}"
            out[name + "_ms"] = graph_ms(call)
            call()
            out[name + "_differ"] = int((q.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
        print(json.dumps(out), flush=True)
    # The attention output's quantization: the plain rows of 4096, beside a copy of their bytes.
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16, generator=g) * 3
    out["plain4096_library_ms"] = graph_ms(lambda: row_quant.quantize_rows_e4m3(x))
    out["plain4096_copy_ms"] = graph_ms(lambda: dst[: rows * 4096 * 3].copy_(src[: rows * 4096 * 3]))
    print(json.dumps(out), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
