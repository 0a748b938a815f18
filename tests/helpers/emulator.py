"""CUDA graphs emulated on the CPU, for tests of code that captures and replays.

A segment records every aten op run while it is open (a ``TorchDispatchMode``) and its replay
runs them again in order on the same tensor objects, writing each result into the tensor the op
produced at capture. So, as on a GPU, a replay reads the recorded inputs (static inputs, boundary
buffers, weights, state slots) as they are *now* and rewrites the recorded outputs, and Python
code inside a segment does not run again. Unlike a GPU capture, ops also run while recorded (the
tests need their values), and recorded tensors never share memory; a host sync inside a segment
(``.item()``, ``.tolist()``) fails the capture as CUDA would.

``emulate_cuda(monkeypatch)`` makes ``GraphRunner`` and ``bcg.capture`` take CPU tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel.graphs import bcg
from accel.graphs import runner as runner_mod
from accel.graphs.runner import GraphRunner
from tests.helpers.fakes import FakePool, fake_cuda_calls

_HOST_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_SYNCS:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _write(recorded: Any, fresh: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        if fresh is recorded or (
            fresh.data_ptr() == recorded.data_ptr() and fresh.stride() == recorded.stride()
        ):  # in place, or a view of the same memory
            return
        recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _write(r, f)


class EmulatedSegment:
    """One recorded segment; :meth:`replay` runs its ops again."""

    def __init__(self, ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            _write(out, func(*args, **kwargs))


def emulate_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph runners capture and replay CPU tensors through emulated segments."""

    def open_(self: Any) -> None:
        rec = _Recorder()
        rec.__enter__()
        self.open_segment = rec

    def close_(self: Any) -> None:
        rec, self.open_segment = self.open_segment, None
        if rec is not None:
            rec.__exit__(None, None, None)
            self.graph.segments.append(EmulatedSegment(rec.ops))

    def abort_(self: Any) -> None:
        rec, self.open_segment = self.open_segment, None
        if rec is not None:
            rec.__exit__(None, None, None)

    monkeypatch.setattr(bcg._Capture, "open", open_)
    monkeypatch.setattr(bcg._Capture, "close", close_)
    monkeypatch.setattr(bcg._Capture, "abort", abort_)
    fake_cuda_calls(monkeypatch)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(runner_mod, "GraphPool", FakePool)
    # The inputs are CPU tensors: skip only the device checks, keep the blocked-signature one.
    monkeypatch.setattr(GraphRunner, "_capturable", lambda self, key, leaves: key not in self.store.blocked)


def segment_replays(runner: GraphRunner) -> int:
    """Segment replays of every chain of every entry of ``runner`` so far."""
    return sum(
        seg.replays
        for entry in runner.store.entries.values()
        for chain in entry.tree.chains.values()
        for seg in chain.graph.segments
    )


def emulate_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`emulate_cuda`, and accelerated pipelines on the CPU warm up and capture too (one
    real pool of the emulated kind for every runner)."""
    from accel.hooks.install import Installation

    emulate_cuda(monkeypatch)
    monkeypatch.setattr(Installation, "why_no_graphs", lambda self, device: None)
    pools: dict[str, object] = {}
    monkeypatch.setattr(
        Installation, "pool_for", lambda self, device: pools.setdefault("cpu", runner_mod.GraphPool(device))
    )
