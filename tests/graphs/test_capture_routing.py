"""A capture that fails leaves the caching allocator routing nothing into its pool.

Torch begins routing a capture's allocations into its pool in ``capture_begin`` and ends it in
``capture_end``, but (2.11 and earlier) only after the CUDA capture ended without error: after an
invalidated capture the allocator counted a capture as under way for good, and emptying the cache
freed nothing of the default pool again (the H200 suite: 131 GiB cached, nothing allocated). The
fakes here behave as both torches do, the one that leaves the routing on and the one that ends it
itself, with the allocator's own bookkeeping: a second end of a pool's routing is refused.
"""

from __future__ import annotations

import pytest
import torch

from accel.graphs import bcg

POOL = (0, 7)
DEVICE = torch.device("cuda", 0)


class Allocator:
    """The caching allocator's list of captures under way: which pools it routes allocations to."""

    def __init__(self) -> None:
        self.routed: list[tuple[int, int]] = []
        self.ends = 0

    def begin(self, pool) -> None:
        self.routed.append(tuple(pool))

    def end(self, device: int, pool) -> None:
        self.ends += 1
        assert device == DEVICE.index
        if tuple(pool) not in self.routed:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routed.remove(tuple(pool))


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    alloc = Allocator()
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", alloc.end, raising=False)
    return alloc


def fake_graph(alloc: Allocator, *, ends_routing_on_error: bool, begin_fails: bool = False):
    """A CUDAGraph whose capture ends in error once :attr:`invalid` is set (a sync slipped in)."""

    class Graph:
        invalid = False

        def capture_begin(self, pool=None, capture_error_mode="global") -> None:
            self.pool = pool
            alloc.begin(pool)
            if begin_fails:
                raise RuntimeError("cudaStreamBeginCapture failed")

        def capture_end(self) -> None:
            if self.invalid:
                if ends_routing_on_error:
                    alloc.routed.remove(tuple(self.pool))
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            alloc.routed.remove(tuple(self.pool))

    return Graph


def capture_of(monkeypatch, alloc: Allocator, **kind) -> bcg._Capture:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", fake_graph(alloc, **kind))
    return bcg._Capture(bcg.BreakableCUDAGraph(), POOL, "thread_local", DEVICE)


@pytest.mark.parametrize("ends_routing_on_error", [False, True], ids=["torch leaves it on", "torch ends it"])
def test_an_invalidated_capture_ends_its_routing_and_its_error_propagates(
    monkeypatch, allocator, ends_routing_on_error
) -> None:
    cap = capture_of(monkeypatch, allocator, ends_routing_on_error=ends_routing_on_error)
    with pytest.raises(RuntimeError, match="item"), bcg._run_capture(cap):
        cap.open_segment.invalid = True
        raise RuntimeError("operation not permitted when stream is capturing: item()")
    assert allocator.routed == []
    assert cap.graph.segments == [] and cap.open_segment is None


@pytest.mark.parametrize("ends_routing_on_error", [False, True], ids=["torch leaves it on", "torch ends it"])
def test_a_segment_that_cannot_close_ends_its_routing(monkeypatch, allocator, ends_routing_on_error) -> None:
    cap = capture_of(monkeypatch, allocator, ends_routing_on_error=ends_routing_on_error)
    cap.open()
    cap.open_segment.invalid = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        cap.close()  # the refused second end (torch that ends it) is not what propagates
    assert allocator.routed == []


def test_segments_that_end_cleanly_are_left_to_torch(monkeypatch, allocator) -> None:
    cap = capture_of(monkeypatch, allocator, ends_routing_on_error=False)
    with bcg._run_capture(cap):
        cap.close()
        cap.open()
    assert allocator.routed == [] and allocator.ends == 0 and len(cap.graph.segments) == 2


def test_a_capture_that_cannot_begin_ends_its_routing(monkeypatch, allocator) -> None:
    cap = capture_of(monkeypatch, allocator, ends_routing_on_error=False, begin_fails=True)
    with pytest.raises(RuntimeError, match="BeginCapture"):
        cap.open()
    assert allocator.routed == [] and cap.open_segment is None


def test_another_pools_routing_is_left_alone(monkeypatch, allocator) -> None:
    allocator.begin((0, 99))  # another library's capture, into a pool of its own
    cap = capture_of(monkeypatch, allocator, ends_routing_on_error=False)
    cap.open()
    cap.open_segment.invalid = True
    cap.abort()
    assert allocator.routed == [(0, 99)]
