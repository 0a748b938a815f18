"""CUDA as far as the graph runner can tell, on the CPU: a fake pool and stream, dummy segments.

* :class:`FakePool` stands in for :class:`accel.graphs.pool.GraphPool`: a lock, a stream, and a
  resident size a test sets (``FakePool.resident``).
* :func:`fake_cuda_calls` makes ``torch.cuda``'s stream, synchronisation and availability calls
  harmless on CPU tensors.
* :func:`fake_capture` does what :func:`accel.graphs.bcg.capture` does, minus CUDA: a real
  capture whose segments are :class:`DummySegment` objects that log their replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel.graphs import bcg
from accel.graphs.bcg import BreakableCUDAGraph


class FakeStream:
    device = torch.device("cpu")

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclasses.dataclass
class FakeCuda:
    """``fail_next_capture``: that many next captures raise (``fail_with``, or a RuntimeError)."""

    fail_next_capture: int = 0
    fail_with: BaseException | None = None
    captures: int = 0
    attempts: int = 0


class FakePool:
    """Stands in for GraphPool: a lock, a stream, and a resident size the test sets."""

    resident = 0
    released = 0  # what emptying the allocator's cache gives back, as the test sets it

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.stream = FakeStream()
        self.give_back_before_capture = False
        self.eager_peak = 0

    def handle_for(self, graph: Any) -> None:
        return None

    def resident_bytes(self) -> int:
        return FakePool.resident

    def make_room(self) -> int:
        return 0

    def release_cached(self) -> int:
        return FakePool.released

    @contextlib.contextmanager
    def measure_eager(self) -> Iterator[None]:
        yield

    def take_eager_peak(self) -> int:
        peak, self.eager_peak = self.eager_peak, 0
        return peak

    def order_after_last_replay(self, stream: Any) -> None:
        pass

    def mark_replay_done(self, stream: Any) -> None:
        pass


def fake_cuda_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda`` says it is there; its streams, synchronisation and cache calls do nothing."""
    FakePool.resident = FakePool.released = 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


class DummySegment:
    def __init__(self, index: int, log: list[str]) -> None:
        self.index = index
        self.log = log

    def replay(self) -> None:
        self.log.append(f"seg{self.index}")


@dataclasses.dataclass
class Fake:
    graph: BreakableCUDAGraph
    cap: Any
    log: list[str]


@contextlib.contextmanager
def fake_capture(
    monkeypatch: pytest.MonkeyPatch, log: list[str] | None = None, graph: BreakableCUDAGraph | None = None
) -> Iterator[Fake]:
    """What :func:`accel.graphs.bcg.capture` does, minus CUDA: open, run the block, close, reset on error.

    Each dummy segment appends ``seg<i>`` to ``log`` when replayed. ``graph``: capture into this
    one (a new one otherwise).
    """
    graph = BreakableCUDAGraph() if graph is None else graph
    cap = bcg._Capture(graph, pool=None, error_mode="thread_local", device=torch.device("cpu"))
    log = [] if log is None else log
    made = [0]

    def open_() -> None:
        cap.open_segment = DummySegment(made[0], log)
        made[0] += 1

    def close_() -> None:
        seg, cap.open_segment = cap.open_segment, None
        if seg is not None:
            graph.segments.append(seg)

    monkeypatch.setattr(cap, "open", open_)
    monkeypatch.setattr(cap, "close", close_)
    with bcg._run_capture(cap):
        yield Fake(graph, cap, log)
