"""The floor a profiled step implies: its matrix products at the device's peak rates, the rest as measured.

The step's GEMM FLOPs come from its Linear layers' shapes (:mod:`benchkit.gemm_shapes`); the peak
rates are those measured on one H200 (shared/baselines/NOTES.md, 2026-12-01: float8 rowwise
``torch._scaled_mm`` 1160-1340 TFLOP/s, bf16 GEMMs 725-777). The floor is a range: every product at
the high end of its peak (the lowest floor) to every product at the low end, plus every other
kernel's time as the profile measured it (attention, norms, float8 quantization, the rest) and no
idle time. A second floor, ``at_shapes``, runs each shape at the rate it reached alone
(:func:`benchkit.gemm_shapes.measure_rates`). Per kind, the measured time beside its floor says
which kernels hold what is left (``excess``): the products, quantization, or idle time.

With ``bandwidth`` (TB/s, the device memory's rate: :func:`benchkit.gemm_shapes.measure_bandwidth`)
a product is also held to the bytes it must move: its floor is the longer of its FLOPs at the peak
and its bytes at that rate (a roofline). Without it the small-M products (a modulation's one row,
a short text's tens) count as nearly free although each reads a whole weight, and the floor
understates the step. Pure arithmetic: no torch.
"""

from __future__ import annotations

from typing import Any

from .gemm_shapes import GemmRow

__all__ = ["GEMM_KINDS", "PEAKS", "floor", "gemm_floors", "kind_row"]

# TFLOP/s, (low, high) of the measured range, one H200 (NOTES.md 2026-12-01).
PEAKS: dict[str, tuple[float, float]] = {"fp8": (1160.0, 1340.0), "bf16": (725.0, 777.0)}
# The profile's kernel kind of the products in each dtype.
GEMM_KINDS = {"fp8": "fp8_gemm", "bf16": "gemm"}


def _ms(tflop: float, rate: float) -> float:
    return tflop / rate * 1e3 if rate > 0 else 0.0


def _row_ms(row: GemmRow, rate: float, bandwidth: float | None) -> float:
    """One row's floor per step, ms: FLOPs at ``rate`` TFLOP/s or bytes at ``bandwidth`` TB/s."""
    compute = _ms(row.flops * row.calls / 1e12, rate)
    return max(compute, _ms(row.bytes * row.calls / 1e12, bandwidth)) if bandwidth else compute


def gemm_floors(
    rows: list[GemmRow], peaks: dict[str, tuple[float, float]], bandwidth: float | None
) -> dict[str, tuple[float, float]]:
    """The products' floor per step, ms, by dtype ("fp8", "bf16"): (every product at the high end of
    its peak, every one at the low end), each held to its bytes where ``bandwidth`` is given."""
    return {
        d: tuple(sum(_row_ms(r, peaks[d][i], bandwidth) for r in rows if r.fp8 == (d == "fp8")) for i in (1, 0))
        for d in ("fp8", "bf16")
    }


def floor(
    kinds: dict[str, dict[str, Any]],
    idle_ms: float,
    rows: list[GemmRow],
    step_ms: float,
    peaks: dict[str, tuple[float, float]] = PEAKS,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    """The floor of one profiled step (see the module docstring).

    Args:
        kinds: the profile's per-kind totals (:func:`benchkit.timeline.summarize`'s ``kinds``).
        idle_ms: the profiled step's idle time.
        rows: the step's products by shape (FLOPs, float8 or bf16, rates measured alone).
        step_ms: the measured step (unprofiled), compared with the floor.
        peaks: (low, high) TFLOP/s per dtype.
        bandwidth: the device memory's TB/s (None: FLOPs alone bound the products).
    """
    tflop = {d: sum(r.flops * r.calls for r in rows if r.fp8 == (d == "fp8")) / 1e12 for d in ("fp8", "bf16")}
    gemm_ms = {d: kinds.get(GEMM_KINDS[d], {}).get("ms_per_step", 0.0) for d in ("fp8", "bf16")}
    at_peak = gemm_floors(rows, peaks, bandwidth)
    measured_all = all(r.tflops for r in rows)
    at_shapes = sum(r.flops * r.calls / 1e12 / r.tflops * 1e3 for r in rows if r.tflops) if measured_all else None
    rest = {k: v.get("ms_per_step", 0.0) for k, v in kinds.items() if k not in GEMM_KINDS.values()}
    rest_ms = sum(rest.values())
    low = at_peak["fp8"][0] + at_peak["bf16"][0] + rest_ms
    high = at_peak["fp8"][1] + at_peak["bf16"][1] + rest_ms
    by_kind = []
    for d in ("fp8", "bf16"):
        if tflop[d] or gemm_ms[d]:
            floor_ms = at_peak[d][1]  # the low end of the peak: what the device reached, not its best
            by_kind.append(kind_row(GEMM_KINDS[d], gemm_ms[d], floor_ms))
    by_kind += [kind_row(k, ms, ms) for k, ms in rest.items() if ms]
    by_kind.append(kind_row("idle", idle_ms, 0.0))
    holder = max(by_kind, key=lambda r: r["excess_ms"]) if by_kind else None
    return {
        "peaks_tflops": {d: list(p) for d, p in peaks.items()},
        "bandwidth_tbs": None if bandwidth is None else round(bandwidth, 3),
        "tflop_per_step": {d: round(v, 6) for d, v in tflop.items()},
        "achieved_tflops": {d: round(tflop[d] / gemm_ms[d] * 1e3, 1) if gemm_ms[d] else None for d in tflop},
        "gemm_ms": {d: round(v, 3) for d, v in gemm_ms.items()},
        "gemm_floor_ms": {d: [round(v, 3) for v in at_peak[d]] for d in at_peak},
        "rest_ms": round(rest_ms, 3),
        "floor_ms": [round(low, 3), round(high, 3)],
        "at_shapes_ms": None if at_shapes is None else round(at_shapes + rest_ms, 3),
        "step_ms": round(step_ms, 3),
        "ratio": [round(step_ms / low, 3) if low else None, round(step_ms / high, 3) if high else None],
        "by_kind": by_kind,
        "holder": holder["kind"] if holder and holder["excess_ms"] > 0 else None,
    }


def kind_row(kind: str, measured: float, floor_ms: float) -> dict[str, Any]:
    """One kind's row of a floor: its measured time per step, its floor, and the excess (ms)."""
    return {
        "kind": kind,
        "measured_ms": round(measured, 3),
        "floor_ms": round(floor_ms, 3),
        "excess_ms": round(measured - floor_ms, 3),
    }
