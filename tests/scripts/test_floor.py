"""scripts/benchkit/gemm_shapes.py and floor.py on the CPU: a step's Linear calls by shape, float8
or bf16, and the floor a profile implies, checked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchkit.floor import PEAKS, floor
from benchkit.gemm_shapes import GemmRow, gemm_rows, measure_rates, record_linears
from benchkit.kernels import KINDS


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)
        self.text = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        q = self.qkv(x)[..., :32]
        return self.out(q) + self.text(t).mean(1, keepdim=True)


def test_linear_calls_by_shape_and_dtype() -> None:
    model = torch.nn.Sequential()
    model.add_module("a", Block())
    model.add_module("b", Block())
    x, t = torch.randn(2, 10, 32), torch.randn(2, 7, 16)
    calls = record_linears(model, lambda: [m(x, t) for m in model])
    assert calls["a.qkv"] == [(20, 32, 96)] and calls["b.text"] == [(14, 16, 32)]
    assert all(not m._forward_pre_hooks for m in model.modules())  # hooks removed
    rows = gemm_rows(calls, fp8_layers=["a.qkv", "b.qkv", "a.out"])
    by = {(r.m, r.k, r.n, r.fp8): r for r in rows}
    assert by[(20, 32, 96, True)].calls == 2 and by[(20, 32, 96, True)].layers == ["a.qkv", "b.qkv"]
    assert by[(20, 32, 32, True)].layers == ["a.out"] and by[(20, 32, 32, False)].layers == ["b.out"]
    assert by[(14, 16, 32, False)].calls == 2
    assert [r.gflop_per_step for r in rows] == sorted((r.gflop_per_step for r in rows), reverse=True)
    assert by[(20, 32, 96, True)].flops == 2 * 20 * 32 * 96
    measure_rates(rows, torch.device("cpu"))  # measured on CUDA only
    assert all(r.tflops is None for r in rows)
    d = by[(20, 32, 96, True)].as_dict()
    assert d["dtype"] == "fp8" and d["layers"] == 2 and d["tflops_alone"] is None and d["ms_per_step_alone"] is None


def _kinds(**ms: float) -> dict[str, dict[str, float]]:
    return {k: {"ms_per_step": ms.get(k, 0.0)} for k in KINDS}


def test_floor_by_hand() -> None:
    # 1.25 TFLOP of float8 products and 0.15 of bf16 per step.
    rows = [
        GemmRow(4096, 3072, 12288, True, 0, []),
        GemmRow(4096, 3072, 3072, False, 0, []),
    ]
    rows[0].calls = round(1.25e12 / rows[0].flops)
    rows[1].calls = round(0.15e12 / rows[1].flops)
    fp8_tflop = rows[0].flops * rows[0].calls / 1e12
    bf16_tflop = rows[1].flops * rows[1].calls / 1e12
    kinds = _kinds(fp8_gemm=1.4, gemm=0.3, quant=0.12, attention=0.5, norm=0.08)
    f = floor(kinds, idle_ms=0.05, rows=rows, step_ms=2.6)
    fp8_lo, fp8_hi = PEAKS["fp8"]
    bf_lo, bf_hi = PEAKS["bf16"]
    rest = 0.12 + 0.5 + 0.08
    low = fp8_tflop / fp8_hi * 1e3 + bf16_tflop / bf_hi * 1e3 + rest
    high = fp8_tflop / fp8_lo * 1e3 + bf16_tflop / bf_lo * 1e3 + rest
    assert f["floor_ms"] == [pytest.approx(low, abs=1e-3), pytest.approx(high, abs=1e-3)]
    assert f["ratio"] == [pytest.approx(2.6 / low, abs=1e-3), pytest.approx(2.6 / high, abs=1e-3)]
    assert f["achieved_tflops"]["fp8"] == pytest.approx(fp8_tflop / 1.4e-3, abs=0.1)
    assert f["rest_ms"] == pytest.approx(rest) and f["at_shapes_ms"] is None  # rates not measured
    by = {r["kind"]: r for r in f["by_kind"]}
    assert by["fp8_gemm"]["floor_ms"] == pytest.approx(fp8_tflop / fp8_lo * 1e3, abs=1e-3)
    assert by["quant"]["excess_ms"] == 0 and by["idle"]["excess_ms"] == pytest.approx(0.05)
    assert f["holder"] == "fp8_gemm"  # 1.4 ms against about 1.08 at the low end of the peak
    rows[0].tflops, rows[1].tflops = 1250.0, 750.0
    at_shapes = fp8_tflop / 1250 * 1e3 + bf16_tflop / 750 * 1e3 + rest
    assert floor(kinds, 0.05, rows, 2.6)["at_shapes_ms"] == pytest.approx(at_shapes, abs=1e-3)


def test_floor_of_a_step_without_kernels_or_products() -> None:
    f = floor(_kinds(), idle_ms=3.0, rows=[], step_ms=3.0)
    assert f["floor_ms"] == [0.0, 0.0] and f["ratio"] == [None, None] and f["holder"] == "idle"
    assert f["achieved_tflops"] == {"fp8": None, "bf16": None}


def test_the_roofline_holds_small_products_to_their_bytes() -> None:
    # A modulation's one row reads its whole weight: at 3 TB/s, 3072x18432 bf16 takes 37.7 us,
    # while its FLOPs at the bf16 peak take under 0.2 us. A 4096-row product stays compute-bound.
    one_row = GemmRow(1, 3072, 18432, False, 10, [])
    big = GemmRow(4096, 3072, 12288, True, 4, [])
    assert one_row.bytes == (3072 * 18432 + 3072) * 2 + 18432 * 2
    assert big.bytes == 3072 * 12288 + 4096 * 3072 + 4096 * 12288 * 2
    kinds = _kinds(fp8_gemm=0.5, gemm=0.45)
    plain = floor(kinds, idle_ms=0.0, rows=[one_row, big], step_ms=1.0)
    roof = floor(kinds, idle_ms=0.0, rows=[one_row, big], step_ms=1.0, bandwidth=3.0)
    bytes_ms = one_row.bytes * 10 / 3.0e12 * 1e3
    fp8_hi = PEAKS["fp8"][1]
    assert roof["gemm_floor_ms"]["bf16"] == [pytest.approx(bytes_ms, abs=1e-3)] * 2
    assert plain["gemm_floor_ms"]["bf16"][1] < bytes_ms / 100
    big_ms = big.flops * 4 / 1e12 / fp8_hi * 1e3
    assert roof["gemm_floor_ms"]["fp8"][0] == pytest.approx(big_ms, abs=1e-3)  # FLOPs, not bytes
    assert roof["floor_ms"][0] == pytest.approx(
        plain["floor_ms"][0] + bytes_ms - plain["gemm_floor_ms"]["bf16"][0], abs=1e-3
    )
    assert roof["bandwidth_tbs"] == 3.0 and plain["bandwidth_tbs"] is None
    by = {r["kind"]: r for r in roof["by_kind"]}
    assert by["gemm"]["excess_ms"] == pytest.approx(0.45 - bytes_ms, abs=1e-3)


def test_work_floor_by_hand() -> None:
    """Products at the peak (or their bytes), attention at FlashAttention-3's rate for its dtype,
    nothing else; every other kind against a floor of 0."""
    from benchkit.attention_shapes import AttentionRow
    from benchkit.work_floor import work_floor

    gemms = [GemmRow(4096, 3072, 12288, True, 10, ["a"]), GemmRow(1, 3072, 18432, False, 4, ["mod"])]
    bf16_att = AttentionRow(
        1, 4096, 4096, 24, 128, False, 2, ["b0.attn"], {"sdpa": 600.0, "fa3": 700.0, "fa3_fp8": 850.0}
    )
    fp8_att = AttentionRow(
        1, 4096, 4096, 24, 128, True, 3, ["b1.attn"], {"sdpa": 600.0, "fa3": 700.0, "fa3_fp8": 850.0}
    )
    kinds = _kinds(fp8_gemm=9.0, gemm=1.5, attention=4.0, quant=2.0, norm=1.0)
    f = work_floor(kinds, idle_ms=0.5, gemms=gemms, attention=[bf16_att, fp8_att], step_ms=20.0, bandwidth=3.0)
    flops = 4 * 4096 * 4096 * 24 * 128
    att = (2 * flops / 700e12 + 3 * flops / 850e12) * 1e3
    assert f["attention_floor_ms"] == pytest.approx(att, abs=1e-3) and f["attention_rates"] == "fa3"
    fp8_lo = 10 * gemms[0].flops / 1e12 / PEAKS["fp8"][1] * 1e3
    bytes_ms = 4 * gemms[1].bytes / 3e12 * 1e3  # the one-row product: its weight's bytes
    assert f["gemm_floor_ms"]["fp8"][0] == pytest.approx(fp8_lo, abs=1e-3)
    assert f["gemm_floor_ms"]["bf16"] == [pytest.approx(bytes_ms, abs=1e-3)] * 2
    assert f["floor_ms"][0] == pytest.approx(fp8_lo + bytes_ms + att, abs=1e-3)
    assert f["floor_all_fp8_attention_ms"][0] < f["floor_ms"][0] < f["floor_all_bf16_attention_ms"][0]
    assert f["attention_layers_fp8"] == ["b1.attn"] and f["ratio"][0] == pytest.approx(
        20.0 / f["floor_ms"][0], rel=1e-3
    )
    by = {r["kind"]: r for r in f["by_kind"]}
    assert by["quant"] == {"kind": "quant", "measured_ms": 2.0, "floor_ms": 0.0, "excess_ms": 2.0}
    assert by["attention"]["floor_ms"] == pytest.approx(att, abs=1e-3) and by["idle"]["excess_ms"] == 0.5
    assert [r["excess_ms"] for r in f["by_kind"]] == sorted((r["excess_ms"] for r in f["by_kind"]), reverse=True)
    # Without FlashAttention-3 measured: cuDNN's rate, and said so.
    for row in (bf16_att, fp8_att):
        row.tflops.update(fa3=None, fa3_fp8=None)
    g = work_floor(kinds, 0.5, gemms, [bf16_att, fp8_att], 20.0, bandwidth=3.0)
    assert g["attention_rates"].startswith("sdpa") and g["attention_floor_ms"] == pytest.approx(
        5 * flops / 600e12 * 1e3, abs=1e-3
    )


def test_attention_calls_by_module_and_shape() -> None:
    from benchkit.attention_shapes import attention_rows, measure_attention_rates, record_attention

    from pipelines.builders import build_transformer

    t = build_transformer("z-image", "tiny")
    x = [torch.randn(t.in_channels, 1, 8, 8)]
    cap = [torch.randn(5, t.config.cap_feat_dim)]
    calls = record_attention(t, lambda: t(x, torch.tensor([0.5]), cap))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in t.modules())  # hooks removed
    assert set(calls) == {n for n, m in t.named_modules() if type(m).__name__ == "Attention"}
    rows = attention_rows(calls, fp8_layers=["layers.0.attention"])
    by_layer = {name: r for r in rows for name in r.layers}
    assert by_layer["layers.0.attention"].fp8 and not by_layer["layers.1.attention"].fp8
    main = by_layer["layers.1.attention"]
    assert main.sq == main.sk and main.sk > by_layer["context_refiner.0.attention"].sk  # text and image joined
    assert main.flops == 4 * main.batch * main.heads * main.sq * main.sk * main.dim
    measure_attention_rates(rows, torch.device("cpu"))  # measured on CUDA only
    assert all(v is None for r in rows for v in r.tflops.values())
