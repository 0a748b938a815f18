"""CUDA graphs emulated on the CPU, for tests of code that captures and replays.

A segment records every aten op run while it is open (a ``TorchDispatchMode``) and its replay
runs them again in order, writing each result into the memory the op produced at capture.

What it models of a real graph:

* a replay reads and writes memory, not Python objects: every tensor an op is recorded with is
  held as an alias of the memory it had then (same storage, offset, sizes and strides). So a
  replay reads the recorded inputs (static inputs, boundary buffers, weights, state slots) as
  that memory holds them *now*: an in-place write, also one through ``.data`` that bumps no
  version counter, is read; after ``param.data = other`` the parameter has other memory and a
  replay still reads the old one, as a GPU graph would;
* Python code inside a segment does not run again;
* a host sync inside a segment (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``) fails
  the capture as CUDA would;
* opted in (``host_copies=True``), host data made into a tensor inside a segment
  (``torch.tensor(list, device=...)``, ``new_tensor``: aten's ``lift_fresh`` of a tensor with
  dimensions) fails the capture as the pageable host-to-device copy it is on a GPU. Opt-in, as on
  the CPU every tensor is a host tensor: a model that builds CPU-side tensors in its forward on
  purpose would fail where a GPU capture would not. A 0-dim tensor is left alone (a CPU scalar
  needs no copy on CUDA either), and so is an empty one (no bytes to copy).

What it does not: ops also run while recorded (the tests need their values); recorded tensors
never share a pool (a freed block is never handed to another tensor), and kernels are the CPU's,
so a GPU's numerics (which kernel a shape or a mask selects) are the GPU tests' to check.

``emulate_cuda(monkeypatch)`` makes ``GraphRunner`` and ``bcg.capture`` take CPU tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from accel.graphs import bcg
from accel.graphs import runner as runner_mod
from accel.graphs.runner import GraphRunner
from tests.helpers.fakes import FakePool, fake_cuda_calls

_HOST_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
}


# The recorder's dispatch runs with globals named as a torch module: the library's search for the
# function a capture failed in (accel.graphs.discover) skips torch's frames, as it skips the C++
# frame a real capture raises from, and so finds the model's code, not this file's.
_DISPATCH = """
def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func in HOST_SYNCS:
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
    if HOST_COPIES[0] and func is LIFT_FRESH and args[0].dim() > 0 and args[0].numel() > 0:
        raise RuntimeError(
            f"CUDA error: operation not permitted when stream is capturing (a pageable host-to-device copy: {func})"
        )
    out = func(*args, **kwargs)
    self.ops.append((func, *tree_map_only(torch.Tensor, memory_of, (args, kwargs, out))))
    return out


def memory_of(t):
    # What a graph holds of a tensor: its memory as it is now, not the Python object, whose
    # memory ``t.data = other`` or ``t.set_(...)`` replaces later. Wrapper subclasses and
    # inference tensors are held as they are.
    if type(t) not in PLAIN or t.layout != torch.strided or t.is_inference():
        return t
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )


def host_read(name):
    # On the CPU these read a tensor's memory without an op (or are no-ops); on CUDA each is a
    # copy to the host, which a capture refuses.
    original = getattr(ORIGINAL_TENSOR, name)

    def read(self, *args, **kwargs):
        if RECORDING:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing (Tensor.{name})")
        return original(self, *args, **kwargs)

    return read
"""
# Tensor methods that copy a device tensor to the host.
HOST_READS = ("tolist", "numpy", "cpu")
_namespace: dict[str, Any] = {
    "__name__": "torch._emulated_capture",
    "HOST_SYNCS": _HOST_SYNCS,
    "HOST_COPIES": [False],
    "LIFT_FRESH": torch.ops.aten.lift_fresh.default,
    "RECORDING": [],
    "ORIGINAL_TENSOR": torch.Tensor,
    "PLAIN": (torch.Tensor, torch.nn.Parameter),
    "torch": torch,
    "tree_map_only": tree_map_only,
}
exec(compile(_DISPATCH, "<emulated CUDA capture>", "exec"), _namespace)
_HOST_READ_METHODS = {name: _namespace["host_read"](name) for name in HOST_READS}


class _Recorder(TorchDispatchMode):
    __torch_dispatch__ = _namespace["__torch_dispatch__"]

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []


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


def emulate_cuda(monkeypatch: pytest.MonkeyPatch, *, host_copies: bool = False) -> None:
    """Graph runners capture and replay CPU tensors through emulated segments; ``host_copies``:
    host data made into a tensor inside a segment fails the capture (see the module docstring)."""

    recording = _namespace["RECORDING"]

    def open_(self: Any) -> None:
        rec = _Recorder()
        rec.__enter__()
        recording.append(rec)
        self.open_segment = rec

    def close_(self: Any) -> None:
        rec, self.open_segment = self.open_segment, None
        if rec is not None:
            recording.remove(rec)
            rec.__exit__(None, None, None)
            self.graph.segments.append(EmulatedSegment(rec.ops))

    def abort_(self: Any) -> None:
        rec, self.open_segment = self.open_segment, None
        if rec is not None:
            recording.remove(rec)
            rec.__exit__(None, None, None)

    monkeypatch.setitem(_namespace, "HOST_COPIES", [host_copies])
    monkeypatch.setattr(bcg._Capture, "open", open_)
    monkeypatch.setattr(bcg._Capture, "close", close_)
    monkeypatch.setattr(bcg._Capture, "abort", abort_)
    for name, method in _HOST_READ_METHODS.items():
        monkeypatch.setattr(torch.Tensor, name, method)
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


def emulate_pipelines(monkeypatch: pytest.MonkeyPatch, *, host_copies: bool = False) -> None:
    """:func:`emulate_cuda` (``host_copies`` as there), and accelerated pipelines on the CPU warm
    up and capture too (one real pool of the emulated kind for every runner)."""
    from accel.hooks.install import Installation

    emulate_cuda(monkeypatch, host_copies=host_copies)
    monkeypatch.setattr(Installation, "why_no_graphs", lambda self, device: None)
    pools: dict[str, object] = {}
    monkeypatch.setattr(
        Installation, "pool_for", lambda self, device: pools.setdefault("cpu", runner_mod.GraphPool(device))
    )
