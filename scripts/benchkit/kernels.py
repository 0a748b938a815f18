"""What a GPU kernel does, read from its name, and where a profiled step's GPU time goes.

:func:`kind` names what a kernel does from the name CUPTI records for it: cuBLAS / CUTLASS /
nvjet GEMMs, flash / cuDNN / memory-efficient attention, inductor's fused Triton kernels (whose
names list the aten ops they fuse: ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3``), ATen's
own elementwise, copy and norm kernels, and the runtime's memcpy / memset records. Kinds:

==============  =================  ==========================================================
kind            group              what
==============  =================  ==========================================================
gemm            GEMM               matrix products (cuBLAS, CUTLASS, nvjet, inductor mm
                                   templates, split-K reductions, implicit-GEMM convolutions)
attention       attention          fused attention (flash, cuDNN SDPA, fmha) and softmax
norm            norm/elementwise   layer / group / RMS norms (a fused kernel with a norm in it)
activation      norm/elementwise   GELU, SiLU, sigmoid, tanh
rope            norm/elementwise   rotary embeddings, read from their ops: complex views and
                                   products, sin / cos, ``cat`` / ``stack`` with ``neg``
elementwise     norm/elementwise   other pointwise and reduction kernels
copy            copies/casts       memcpy, memset, ``copy_``, ``_to_copy``, ``cat``, clones,
                                   fills, gathers: data moved, nothing computed
other           other              anything else (collectives, sorting, unknown libraries)
==============  =================  ==========================================================

A fused kernel gets the kind of the op that dominates it: attention, then a norm's reduction,
then rope, then an activation; one that only moves data is a copy. Names are matched
case-insensitively; nothing here imports torch.

:func:`summarize` turns a profiled timeline (device events with start and end in ns, and the
wall-time window of each step) into per-kernel and per-kind totals, busy time (the union of the
events' intervals, so overlapping streams count once) and idle time (the window minus busy).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "DESCRIPTIONS",
    "GROUPS",
    "KINDS",
    "DeviceEvent",
    "busy_ns",
    "clip",
    "fused_ops",
    "idle_ns",
    "kind",
    "summarize",
    "union",
]

KINDS: tuple[str, ...] = ("gemm", "attention", "norm", "activation", "rope", "elementwise", "copy", "other")
GROUPS: dict[str, str] = {
    "gemm": "GEMM",
    "attention": "attention",
    "norm": "norm/elementwise",
    "activation": "norm/elementwise",
    "rope": "norm/elementwise",
    "elementwise": "norm/elementwise",
    "copy": "copies/casts",
    "other": "other",
}
DESCRIPTIONS: dict[str, str] = {
    "gemm": "matrix products (cuBLAS, CUTLASS, nvjet, inductor mm templates)",
    "attention": "fused attention (flash, cuDNN SDPA, fmha), softmax",
    "norm": "layer / group / RMS norms, with what is fused into them",
    "activation": "GELU, SiLU, sigmoid, tanh",
    "rope": "rotary embeddings (complex products, sin/cos, cat/stack with neg)",
    "elementwise": "other pointwise and reduction kernels",
    "copy": "memcpy, memset, copy_, _to_copy, cat, clone, fill, gather",
    "other": "everything else",
}

# -- inductor's Triton kernels ----------------------------------------------------------------
# triton_{poi|red|per|tem|...}_fused_<aten ops joined by "_">_<n>: the ops are those of the FX
# nodes the kernel came from (inductor's default "original_aten" descriptive names).
_TRITON = re.compile(r"^triton_(?P<kind>[a-z]+)(?:_fused)?(?P<ops>(?:_.*?)??)(?:_\d+)*$")
# Op names with underscores of their own, joined so that splitting on "_" keeps them whole.
_MULTI_WORD = tuple(
    sorted(
        (
            "native_layer_norm",
            "native_group_norm",
            "native_batch_norm",
            "layer_norm",
            "group_norm",
            "batch_norm",
            "rms_norm",
            "var_mean",
            "to_copy",
            "view_as_complex",
            "view_as_real",
            "unsafe_view",
            "constant_pad_nd",
            "as_strided",
            "scaled_dot_product",
            "flex_attention",
            "index_put",
            "index_select",
            "slice_scatter",
            "select_scatter",
            "masked_fill",
            "new_zeros",
            "new_empty",
            "new_ones",
            "zeros_like",
            "ones_like",
            "empty_like",
            "full_like",
            "lift_fresh",
        ),
        key=len,
        reverse=True,
    )
)
_TRITON_ATTENTION = {"softmax", "scaleddotproduct", "flexattention", "attention", "sdpa"}
_TRITON_NORM = {
    "nativelayernorm",
    "nativegroupnorm",
    "nativebatchnorm",
    "layernorm",
    "groupnorm",
    "batchnorm",
    "rmsnorm",
    "rms",
    "rsqrt",
    "varmean",
}
_TRITON_ROPE = {"viewascomplex", "viewasreal", "complex", "polar", "rotary", "rope", "sin", "cos"}
_ACTIVATIONS = {"gelu", "silu", "sigmoid", "tanh", "relu", "mish", "softplus", "glu", "hardswish"}
_TRITON_GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution"}
_MOVEMENT = {
    "tocopy",
    "copy",
    "clone",
    "cat",
    "stack",
    "view",
    "unsafeview",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "t",
    "expand",
    "slice",
    "select",
    "narrow",
    "split",
    "unbind",
    "squeeze",
    "unsqueeze",
    "contiguous",
    "alias",
    "asstrided",
    "constantpadnd",
    "pad",
    "repeat",
    "roll",
    "flip",
    "index",
    "indexselect",
    "indexput",
    "gather",
    "scatter",
    "slicescatter",
    "selectscatter",
    "fill",
    "zeros",
    "ones",
    "full",
    "empty",
    "newzeros",
    "newempty",
    "newones",
    "zeroslike",
    "oneslike",
    "emptylike",
    "fulllike",
    "liftfresh",
    "detach",
}

# -- everything else: substrings of the lower-cased (demangled) name, checked in this order ----
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn", "softmax")
_GEMM = (
    "gemm",
    "gemv",
    "nvjet",
    "xmma",
    "cutlass",
    "cublas",
    "matmul",
    "wgmma",
    "s16816",
    "h16816",
    "s1688",
    "hmma",
    "fprop",
    "convolution",
)
_NORM = (
    "layer_norm",
    "layernorm",
    "group_norm",
    "groupnorm",
    "rms_norm",
    "rmsnorm",
    "batch_norm",
    "batchnorm",
    "rowwisemoments",
    "computefusedparams",
)
_ROPE = ("complex", "rotary")
_COPY = (
    "memcpy",
    "memset",
    "copy",
    "catarray",
    "fillfunctor",
    "fill_kernel",
    "index_elementwise",
    "indexselect",
    "index_select",
    "gather",
    "scatter",
)
_ELEMENTWISE = ("elementwise", "reduce_kernel", "functor", "pointwise", "triton")


def fused_ops(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(triton kind, ops)`` of an inductor Triton kernel name, else None.

    ``"triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3"`` ->
    ``("red", ("tocopy", "add", "mean", "mul", "pow", "rsqrt"))``: multi-word aten ops are
    joined (``_to_copy`` -> ``tocopy``), the trailing kernel number dropped.
    """
    m = _TRITON.match(name.strip().lower())
    if m is None:
        return None
    ops = m.group("ops")
    for word in _MULTI_WORD:
        ops = ops.replace(word, word.replace("_", ""))
    return m.group("kind"), tuple(t for t in ops.split("_") if t)


def _triton_kind(triton: str, ops: tuple[str, ...]) -> str:
    tokens = set(ops)
    if tokens & _TRITON_ATTENTION:
        return "attention"
    if triton == "tem":  # templates: matmuls (and convolutions) unless flex attention, above
        return "gemm"
    if tokens & _TRITON_GEMM:
        return "gemm"
    if tokens & _TRITON_NORM:
        return "norm"
    if tokens & _TRITON_ROPE or ("neg" in tokens and tokens & {"cat", "stack"}):
        return "rope"
    if tokens & _ACTIVATIONS:
        return "activation"
    if tokens and tokens <= _MOVEMENT:
        return "copy"
    return "elementwise"


def kind(name: str) -> str:
    """What the kernel called ``name`` does: one of :data:`KINDS`."""
    triton = fused_ops(name)
    if triton is not None:
        return _triton_kind(*triton)
    n = name.lower()
    if n.startswith(("memcpy", "memset")):  # the runtime's own records: "Memcpy DtoD (Device -> Device)"
        return "copy"
    if "nccl" in n:  # collectives, before "gather" calls an all-gather a copy
        return "other"
    for found, substrings in (
        ("attention", _ATTENTION),  # before GEMM: flash kernels are CUTLASS templates
        ("gemm", _GEMM),
        ("norm", _NORM),
        ("activation", tuple(_ACTIVATIONS)),
        ("rope", _ROPE),  # before copy: the copy out of a complex view is the rotary's
        ("copy", _COPY),
        ("elementwise", _ELEMENTWISE),
    ):
        if any(s in n for s in substrings):
            return found
    return "other"


# -- intervals --------------------------------------------------------------------------------
def union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``[start, end)`` intervals as sorted, disjoint intervals (touching ones
    joined; empty or reversed ones dropped)."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def busy_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Length of the union of the intervals: time at least one of them was running."""
    return sum(e - s for s, e in union(intervals))


def clip(intervals: Iterable[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of the intervals that lie inside ``[start, end)``."""
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


def idle_ns(window: tuple[int, int], intervals: Iterable[tuple[int, int]]) -> int:
    """Time inside ``window`` when none of the intervals was running."""
    start, end = window
    return max(0, end - start) - busy_ns(clip(intervals, start, end))


# -- a profiled timeline ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """One kernel, memcpy or memset on the device: its name and ``[start_ns, end_ns)``."""

    name: str
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def _ms(ns: float) -> float:
    return round(ns / 1e6, 4)


def summarize(events: Sequence[DeviceEvent], windows: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Per-kernel and per-kind GPU time of the profiled steps, busy and idle time.

    Args:
        events: the device's kernels, memcpys and memsets.
        windows: the wall-time window of each step (``[start_ns, end_ns)``, disjoint), each
            from the step's first launch to the end of its synchronisation.

    Returns:
        A JSON-ready dict. Each event belongs to the window its start lies in; events in no
        window are counted in ``unassigned`` and otherwise left out. Times per step are means
        over the steps; shares are of the step's wall time, so the kinds' shares plus idle's add
        up to 1 plus ``overlap`` (kernels running at once on several streams). ``gaps_ms`` is
        the idle time between a step's first and last event; the rest of ``idle_ms`` lies at
        the window's edges (launching the first kernel, returning from the synchronisation).
    """
    if not windows:
        raise ValueError("windows: no profiled step to summarize")
    windows = sorted(windows)
    starts = [w[0] for w in windows]
    per_window: list[list[DeviceEvent]] = [[] for _ in windows]
    unassigned = 0
    for ev in events:
        i = bisect.bisect_right(starts, ev.start_ns) - 1
        if i >= 0 and ev.start_ns < windows[i][1]:
            per_window[i].append(ev)
        else:
            unassigned += 1
    n = len(windows)
    wall_total = sum(e - s for s, e in windows)
    per_step: list[dict[str, Any]] = []
    busy_total = gaps_total = 0
    for (s, e), evs in zip(windows, per_window):
        spans = [(ev.start_ns, ev.end_ns) for ev in evs]
        busy = busy_ns(clip(spans, s, e))
        gaps = 0
        if evs:
            first, last = min(ev.start_ns for ev in evs), min(e, max(ev.end_ns for ev in evs))
            gaps = idle_ns((first, last), spans)
        busy_total += busy
        gaps_total += gaps
        per_step.append({"wall_ms": _ms(e - s), "busy_ms": _ms(busy), "idle_ms": _ms(e - s - busy), "events": len(evs)})
    kernels: dict[str, dict[str, Any]] = {}
    for evs in per_window:
        for ev in evs:
            k = kernels.setdefault(ev.name, {"kind": kind(ev.name), "count": 0, "total_ns": 0})
            k["count"] += 1
            k["total_ns"] += ev.duration_ns
    kinds = {k: {"group": GROUPS[k], "count": 0, "total_ns": 0} for k in KINDS}
    for k in kernels.values():
        kinds[k["kind"]]["count"] += k["count"]
        kinds[k["kind"]]["total_ns"] += k["total_ns"]

    def share(ns: float) -> float:
        return round(ns / wall_total, 4) if wall_total > 0 else 0.0

    kernel_total = sum(k["total_ns"] for k in kernels.values())
    idle_total = wall_total - busy_total
    return {
        "steps": n,
        "step_ms": _ms(wall_total / n),
        "busy_ms": _ms(busy_total / n),
        "idle_ms": _ms(idle_total / n),
        "idle_share": share(idle_total),
        "gaps_ms": _ms(gaps_total / n),
        "kernel_ms": _ms(kernel_total / n),
        "overlap_ms": _ms((kernel_total - busy_total) / n),
        "events": sum(len(evs) for evs in per_window),
        "unassigned": unassigned,
        "kinds": {
            name: {
                "group": k["group"],
                "count_per_step": round(k["count"] / n, 2),
                "total_us": round(k["total_ns"] / 1e3, 1),
                "ms_per_step": _ms(k["total_ns"] / n),
                "share": share(k["total_ns"]),
            }
            for name, k in kinds.items()
        },
        "kernels": {
            name: {
                "kind": k["kind"],
                "count": k["count"],
                "total_us": round(k["total_ns"] / 1e3, 1),
                "ms_per_step": _ms(k["total_ns"] / n),
                "share": share(k["total_ns"]),
            }
            for name, k in sorted(kernels.items(), key=lambda item: -item[1]["total_ns"])
        },
        "per_step": per_step,
    }
