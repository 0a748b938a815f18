"""The floors of scripts/profile_step.py's variants: the step's products (and attention) by shape,
timed alone on the device, then each variant's floor as measured kernels imply it
(:mod:`benchkit.floor`) and from the work alone (:mod:`benchkit.work_floor`)."""

from __future__ import annotations

from typing import Any

import torch

from .attention_shapes import attention_rows, measure_attention_rates, record_attention
from .floor import floor
from .gemm_shapes import gemm_rows, measure_bandwidth, measure_rates, record_linears
from .work_floor import work_floor

__all__ = ["floors", "record_step"]


def record_step(model: torch.nn.Module, step: Any) -> tuple[dict[str, list], dict[str, list]]:
    """One ``step()`` of the stock ``model``: its Linear calls and its attention calls by name."""
    linears: dict[str, list] = {}
    attention = record_attention(model, lambda: linears.update(record_linears(model, step)))
    return linears, attention


def floors(
    pipe: Any,
    device: torch.device,
    variant: str,
    main: dict[str, Any],
    beside: dict[str, Any] | None,
    shapes: dict[str, list],
    attention_calls: dict[str, list],
) -> dict[str, Any]:
    """``gemms``, ``attention``, ``floor`` and ``work_floor`` of profile.json for ``main`` (the
    variant named ``variant``, the pipeline as it is now) and the bf16 step ``beside`` it."""
    q = pipe.accel.quantization
    selection = q.selection if q is not None else None
    fp8 = selection.quantized if selection is not None else ()
    fp8_attention = selection.attention if selection is not None else ()
    rows, rows_bf16 = gemm_rows(shapes, fp8), gemm_rows(shapes, ())
    measure_rates(rows + (rows_bf16 if fp8 else []), device)
    att, att_bf16 = attention_rows(attention_calls, fp8_attention), attention_rows(attention_calls, ())
    measure_attention_rates(att, device)
    by_shape = {(r.batch, r.sq, r.sk, r.heads, r.dim): r.tflops for r in att}
    for r in att_bf16:
        r.tflops = dict(by_shape[(r.batch, r.sq, r.sk, r.heads, r.dim)])
    bw = measure_bandwidth(device)
    out: dict[str, Any] = {"gemms": [r.as_dict() for r in rows], "attention": [r.as_dict() for r in att]}
    prof, step_ms = main["profile"], main["timing"]["step_ms"]
    out["floor"] = {variant: floor(prof["kinds"], prof["idle_ms"], rows, step_ms, bandwidth=bw)}
    out["work_floor"] = {variant: work_floor(prof["kinds"], prof["idle_ms"], rows, att, step_ms, bandwidth=bw)}
    if beside is not None:
        kinds, idle, ms = beside["profile"]["kinds"], beside["profile"]["idle_ms"], beside["timing"]["step_ms"]
        out["floor"]["bf16 beside"] = floor(kinds, idle, rows_bf16, ms, bandwidth=bw)
        out["work_floor"]["bf16 beside"] = work_floor(kinds, idle, rows_bf16, att_bf16, ms, bandwidth=bw)
    return out
