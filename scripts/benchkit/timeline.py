"""Where a profiled step's GPU time goes: intervals, busy and idle time, and the per-kind summary.

:func:`summarize` turns a profiled timeline (device events with start and end in ns, and the
wall-time window of each step) into per-kernel and per-kind totals (kinds from
:mod:`benchkit.kernels`), busy time (the union of the events' intervals, so overlapping streams
count once) and idle time (the window minus busy). Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .kernels import GROUPS, KINDS, kind

__all__ = ["DeviceEvent", "busy_ns", "clip", "idle_ns", "summarize", "union"]


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
