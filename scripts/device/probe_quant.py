"""What float8 activation quantization and small float8 products cost on this GPU, alone.

    python3 scripts/device/probe_quant.py --out out/probe-quant.json

Two questions from the Qwen-Image float8 profile (issue #49), where quantization kernels took
34.7 ms of a 213 ms step, about 2.5x what their bytes take, and the text stream's and
modulation's bf16 products 24.5 ms at a few dozen rows and one row:

* Quantization: per-row e4m3 quantization (the same operations as torchao's and
  :func:`accel.hooks.fp8.scaled_mm.quantize_rows`) of the step's activations (Qwen-Image
  1024x1024: 4096 rows of 3072 and, after GELU(tanh), of 12288), compiled by inductor under
  several settings, against a copy of the same bytes. Each variant's bits are compared with the
  default's.
* Small products: ``torch._scaled_mm`` per-row at the text stream's and modulation's rows against
  bf16 ``F.linear``; whether cuBLASLt takes each shape at all.

Every time is the median of CUDA-graph replays of 20 back-to-back calls (no launch overhead).
"""

# ruff: noqa: B023  (every lambda is timed where it is made)
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import graph_ms


def _triton_gelu_quant():
    """One program per row, the whole row in registers: one read, one write."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, q_ptr, s_ptr, K, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            e = tl.exp(-2.0 * tl.abs(inner))
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(inner < 0, -t, t)
            x = (0.5 * x * (1.0 + t)).to(tl.bfloat16).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
        scale = (amax / 448.0).to(tl.bfloat16).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    def run(x, gelu: bool):
        import torch

        m, k = x.shape
        q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(k)
        kernel[(m,)](x, q, s, k, GELU=gelu, BLOCK=block, num_warps=16 if block >= 8192 else 8)
        return q, s

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from accel.hooks.fp8 import quantize_rows

    dev = torch.device("cuda")
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "quant": [], "gemm": []}

    def gelu_quant(x):
        return quantize_rows(F.gelu(x, approximate="tanh"))

    def norm_quant(x, shift, scale):
        y = F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift
        return quantize_rows(y)

    settings = {
        "default": {},
        "coordinate_descent": {"coordinate_descent_tuning": True},
        "multi_kernel": {"triton.multi_kernel": 1},
        "persistent": {"triton.multi_kernel": 2},
    }
    cases = [
        (
            "gelu+quant 4096x12288",
            gelu_quant,
            lambda: (torch.randn(4096, 12288, device=dev, dtype=torch.bfloat16) * 3,),
        ),
        ("quant 4096x3072", quantize_rows, lambda: (torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16) * 3,)),
        (
            "layernorm+modulate+quant 4096x3072",
            norm_quant,
            lambda: (
                torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16) * 3,
                torch.randn(1, 3072, device=dev, dtype=torch.bfloat16),
                torch.randn(1, 3072, device=dev, dtype=torch.bfloat16),
            ),
        ),
    ]
    triton_run = _triton_gelu_quant()
    for label, fn, make in cases:
        args = make()
        x = args[0]
        copy_src = torch.empty(x.numel() * 3 // 2, dtype=torch.uint8, device=dev)
        copy_dst = torch.empty_like(copy_src)
        row = {"case": label, "copy_ms": graph_ms(lambda: copy_dst.copy_(copy_src)), "bytes_one_pass": x.numel() * 3}
        ref = None
        for name, opts in settings.items():
            torch._dynamo.reset()
            try:
                compiled = torch.compile(fn, options=opts or None, dynamic=False)
                out = compiled(*args)
                row[name + "_ms"] = graph_ms(lambda: compiled(*args))
                if ref is None:
                    ref = out
                else:
                    row[name + "_equal"] = bool(
                        torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])
                    )
            except Exception as e:
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "gelu" in label or label.startswith("quant"):
            gelu = "gelu" in label
            try:
                out = triton_run(x, gelu)
                row["triton_row_ms"] = graph_ms(lambda: triton_run(x, gelu))
                if ref is not None:
                    row["triton_row_equal"] = bool(torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)))
                    row["triton_row_scale_equal"] = bool(torch.equal(out[1], ref[1]))
                    row["triton_row_maxdiff_levels"] = int(
                        (out[0].view(torch.uint8).int() - ref[0].view(torch.uint8).int()).abs().max()
                    )
            except Exception as e:
                row["triton_row_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["quant"].append(row)
        print(json.dumps(row), flush=True)

    torch._dynamo.reset()
    for k, n in ((3072, 3072), (3072, 12288), (12288, 3072), (3072, 18432)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_rows(w)
        for m in (1, 2, 21, 42, 66, 132):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            row = {"m": m, "k": k, "n": n, "bf16_ms": graph_ms(lambda: F.linear(x, w))}
            try:
                torch._scaled_mm(
                    xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True
                )
                row["fp8_ms"] = graph_ms(
                    lambda: torch._scaled_mm(
                        xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True
                    )
                )
            except Exception as e:
                row["fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["weight_mb_bf16"] = round(n * k * 2 / 1e6, 1)
            result["gemm"].append(row)
            print(json.dumps(row), flush=True)

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
