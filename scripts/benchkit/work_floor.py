"""The floor from the work: what a step would take if only its arithmetic and its weights' bytes
cost time, against the measured step, kernel by kernel.

:mod:`benchkit.floor` counts every kernel but the products as measured: today's quantization,
norms and attention are taken as given. This floor counts only the work the step must do:

* each matrix product at the measured peak of its dtype (float8 for the layers the selection put
  in float8, bf16 for the rest), or, where longer, its weight's and input's bytes at the memory's
  rate (the one-row modulation products, a short text's: bound by the weight they read);
* each attention call's FLOPs at FlashAttention-3's rate measured alone at its shape, in float8
  for the attention layers in float8, bf16 for the rest (:mod:`benchkit.attention_shapes`);
  without the wheel, SDPA's (cuDNN's) rate, and the floor says so;
* nothing else: norms, activations, quantization, rotary embeddings, copies and idle time are
  what fusion has left to remove (each is listed against a floor of 0).

Two more totals for what float8 attention would give: every attention call in bf16 and every one in
float8. Pure arithmetic: no torch.
"""

from __future__ import annotations

from typing import Any

from .attention_shapes import AttentionRow
from .floor import GEMM_KINDS, PEAKS, gemm_floors, kind_row
from .gemm_shapes import GemmRow

__all__ = ["work_floor"]


def _attention_ms(rows: list[AttentionRow], fp8: bool | None) -> tuple[float, str | None]:
    """The attention's floor per step, ms, each row at its FA3 rate (float8 where ``fp8``, or as
    the row is where None); and the kernel whose rates it used where FA3 was not measured."""
    total, fallback = 0.0, None
    for row in rows:
        use_fp8 = row.fp8 if fp8 is None else fp8
        rate = row.tflops.get("fa3_fp8" if use_fp8 else "fa3")
        if not rate:
            rate, fallback = row.tflops.get("sdpa"), "sdpa"
        if rate:
            total += row.flops * row.calls / 1e12 / rate * 1e3
    return total, fallback


def work_floor(
    kinds: dict[str, dict[str, Any]],
    idle_ms: float,
    gemms: list[GemmRow],
    attention: list[AttentionRow],
    step_ms: float,
    peaks: dict[str, tuple[float, float]] = PEAKS,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    """The floor of one step from its work (see the module docstring).

    Args:
        kinds: the profile's per-kind totals (``ms_per_step`` each).
        idle_ms: the profiled step's idle time.
        gemms: the step's products by shape, float8 or bf16 as the step runs them.
        attention: the step's attention calls by shape, float8 or bf16, with their rates.
        step_ms: the measured step (unprofiled).
        peaks: (low, high) TFLOP/s per dtype of the products.
        bandwidth: the device memory's TB/s (None: FLOPs alone bound the products).
    """
    gemm = gemm_floors(gemms, peaks, bandwidth)
    gemm_low, gemm_high = (gemm["fp8"][i] + gemm["bf16"][i] for i in (0, 1))
    att_ms, fallback = _attention_ms(attention, None)
    all_bf16, _ = _attention_ms(attention, False)
    all_fp8, _ = _attention_ms(attention, True)
    low, high = gemm_low + att_ms, gemm_high + att_ms
    by_kind = []
    for d in ("fp8", "bf16"):
        measured = kinds.get(GEMM_KINDS[d], {}).get("ms_per_step", 0.0)
        if measured or gemm[d][1]:
            by_kind.append(kind_row(GEMM_KINDS[d], measured, gemm[d][1]))
    by_kind.append(kind_row("attention", kinds.get("attention", {}).get("ms_per_step", 0.0), att_ms))
    shown = {*GEMM_KINDS.values(), "attention"}
    by_kind += [
        kind_row(k, v.get("ms_per_step", 0.0), 0.0) for k, v in kinds.items() if k not in shown and v.get("ms_per_step")
    ]
    by_kind.append(kind_row("idle", idle_ms, 0.0))
    return {
        "peaks_tflops": {d: list(p) for d, p in peaks.items()},
        "bandwidth_tbs": None if bandwidth is None else round(bandwidth, 3),
        "gemm_floor_ms": {d: [round(v, 3) for v in gemm[d]] for d in gemm},
        "attention_floor_ms": round(att_ms, 3),
        "attention_rates": "sdpa (no FlashAttention-3 measured)" if fallback else "fa3",
        "attention_tflop_per_step": round(sum(r.flops * r.calls for r in attention) / 1e12, 6),
        "attention_layers_fp8": sorted({name for r in attention if r.fp8 for name in r.layers}),
        "floor_ms": [round(low, 3), round(high, 3)],
        "floor_all_bf16_attention_ms": [round(gemm_low + all_bf16, 3), round(gemm_high + all_bf16, 3)],
        "floor_all_fp8_attention_ms": [round(gemm_low + all_fp8, 3), round(gemm_high + all_fp8, 3)],
        "step_ms": round(step_ms, 3),
        "ratio": [round(step_ms / low, 3) if low else None, round(step_ms / high, 3) if high else None],
        "by_kind": sorted(by_kind, key=lambda r: -r["excess_ms"]),
    }
