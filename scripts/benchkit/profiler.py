"""One profiler session over a few steps, and the device's kernels and step windows read out of it.

:func:`profile` runs a settling step, then ``steps`` steps, each inside a ``record_function``
window (``profile_step/<i>``) that ends with a synchronisation, under ``torch.profiler`` with CPU
and CUDA activity. :func:`timeline` reads the profile: the device's work (kernels, memcpys,
memsets; not the GPU side of annotations, not synchronisations) outside the settling step, and
the wall-time window of each profiled step, in step order. Kernel launches are attributed by
time, not by correlation id (a graph replay's kernels all correlate to one ``cudaGraphLaunch``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .timeline import DeviceEvent

__all__ = ["SETTLE_LABEL", "STEP_LABEL", "profile", "timeline"]

STEP_LABEL = "profile_step/"
SETTLE_LABEL = "profile_step/settle"
# Device-side records that are not work: the GPU side of record_function ranges, synchronisations.
# Everything else on the CUDA device counts (kineto's "kernel", "gpu_memcpy", "gpu_memset").
NOT_WORK = ("annotation", "sync")
# CUPTI's synchronisation records on the device timeline (not work), by name, for a torch whose
# events do not say their activity type (torch 2.11's _KinetoEvent has no activity_type()).
_SYNC_NAMES = ("Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event")


def _activity(e: Any) -> str:
    """The kineto activity type of a profiler event ("kernel", "gpu_memcpy", "gpu_user_annotation", ...)."""
    method = getattr(e, "activity_type", None)
    if method is not None:
        return method()
    if getattr(e, "is_user_annotation", lambda: False)() or e.name().startswith(STEP_LABEL):
        return "gpu_user_annotation"
    if e.device_type() == torch.autograd.DeviceType.CPU:
        return "cpu_op"
    name = e.name()
    if name in _SYNC_NAMES:
        return "cuda_sync"
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"


def timeline(prof: Any) -> tuple[list[DeviceEvent], list[tuple[int, int]], dict[str, int]]:
    """(device events outside the settling step, the profiled steps' windows in order, counts)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = list(prof.profiler.kineto_results.events())
    steps: dict[int, tuple[int, int]] = {}
    settle: tuple[int, int] | None = None
    for e in events:
        name = e.name()
        if e.device_type() == cpu and name.startswith(STEP_LABEL):
            if name == SETTLE_LABEL:
                settle = (e.start_ns(), e.end_ns())
            else:
                steps[int(name[len(STEP_LABEL) :])] = (e.start_ns(), e.end_ns())
    activities = Counter(_activity(e) for e in events if e.device_type() == cuda)
    device = [
        DeviceEvent(e.name(), e.start_ns(), e.end_ns())
        for e in events
        if e.device_type() == cuda and not any(w in _activity(e) for w in NOT_WORK)
    ]
    settled = [ev for ev in device if settle is None or not settle[0] <= ev.start_ns < settle[1]]
    counts = {
        "cpu_ops": sum(1 for e in events if e.device_type() == cpu and _activity(e) == "cpu_op"),
        "device_events": len(device),
        "settle_events": len(device) - len(settled),
        **{f"activity:{k}": v for k, v in sorted(activities.items())},
    }
    return settled, [steps[i] for i in sorted(steps)], counts


def profile(
    steps: int, step: Callable[[], None], sync: Callable[[], None], cuda: bool
) -> tuple[Any, list[DeviceEvent], list[tuple[int, int]], dict[str, int]]:
    """One profiler session: a settling step, then ``steps`` steps, each in its window and
    synchronised (``sync``) inside it; the profile and :func:`timeline` of it."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        with record_function(SETTLE_LABEL):
            step()
            sync()
        for i in range(steps):
            with record_function(f"{STEP_LABEL}{i}"):
                step()
                sync()
    return (prof, *timeline(prof))
