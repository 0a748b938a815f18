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

import contextlib
import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel.graphs import bcg
from accel.graphs import runner as runner_mod
from accel.graphs.runner import GraphRunner

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


class _FakeStream:
    device = torch.device("cpu")

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FakePool:
    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.stream = _FakeStream()

    def handle_for(self, graph: Any) -> None:
        return None

    def resident_bytes(self) -> int:
        return 0

    def order_after_last_replay(self, stream: Any) -> None:
        pass

    def mark_replay_done(self, stream: Any) -> None:
        pass


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runner_mod, "GraphPool", _FakePool)
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
