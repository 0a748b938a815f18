"""A capture's memory: the allocator's cache is given back before a capture that would run short,
and a capture that ran out of memory is tried once more after emptying it.

While a capture runs, PyTorch's caching allocator frees none of its cached segments, so memory
cached outside the graph pool (a compile's autotuning, a model let go) is lost to it.
"""

from __future__ import annotations

import contextlib

import torch

from accel import GraphRunner
from accel.graphs.pool import GraphPool
from tests.helpers.fakes import FakeCuda, FakePool

GiB = 1 << 30


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _out_of_memory() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")


def test_a_capture_out_of_memory_is_tried_again_after_the_cache_gave_memory_back(fake_cuda: FakeCuda) -> None:
    FakePool.released = 3 * GiB
    fake_cuda.fail_next_capture, fake_cuda.fail_with = 1, _out_of_memory()
    runner = GraphRunner(_scale, name="oom", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    st = runner.stats()
    assert fake_cuda.attempts == 2 and not runner.blocked
    assert (st.captures, st.capture_failures, st.entries, st.eager_calls) == (1, 0, 1, 0)
    y = torch.randn(2, 3)
    assert torch.equal(runner(y), y * 2.0) and runner.stats().replays == 2


def test_a_capture_out_of_memory_is_blocked_when_emptying_the_cache_gives_nothing(fake_cuda: FakeCuda) -> None:
    fake_cuda.fail_next_capture, fake_cuda.fail_with = 1, _out_of_memory()
    runner = GraphRunner(_scale, name="oom", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    assert fake_cuda.attempts == 1
    (reason,) = runner.blocked.values()
    assert reason.startswith("OutOfMemoryError: CUDA out of memory")
    assert (runner.stats().capture_failures, runner.stats().eager_calls) == (1, 1)


def test_a_capture_is_tried_again_only_once(fake_cuda: FakeCuda) -> None:
    FakePool.released = 3 * GiB
    fake_cuda.fail_next_capture, fake_cuda.fail_with = 2, _out_of_memory()
    runner = GraphRunner(_scale, name="oom", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    assert fake_cuda.attempts == 2 and len(runner.blocked) == 1
    assert runner.stats().capture_failures == 1


def test_other_capture_failures_are_not_tried_again(fake_cuda: FakeCuda) -> None:
    FakePool.released = 3 * GiB
    fake_cuda.fail_next_capture = 1  # a RuntimeError
    runner = GraphRunner(_scale, name="other", capture_on_miss=True, debug=True)
    runner(torch.randn(2, 3))
    assert fake_cuda.attempts == 1 and len(runner.blocked) == 1


def test_every_capture_makes_room_first(fake_cuda: FakeCuda, monkeypatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(FakePool, "make_room", lambda self: asked.append(fake_cuda.attempts) or 0)
    runner = GraphRunner(_scale, name="room", capture_on_miss=True, debug=True)
    runner(torch.randn(2, 3))
    runner(torch.randn(4, 3))
    assert asked == [0, 1]  # before each capture began, not after


def _pool_on(monkeypatch, *, free: int, reserved: int, allocated: int) -> tuple[GraphPool, list[int]]:
    """A GraphPool over a device whose allocator reports these numbers; emptying its cache gives
    back what was reserved and not allocated."""
    state = {"reserved": reserved}
    emptied: list[int] = []

    def empty_cache() -> None:
        emptied.append(state["reserved"] - allocated)
        state["reserved"] = allocated

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    pool = object.__new__(GraphPool)  # no device to take a pool handle and stream on
    pool.device = torch.device("cuda", 0)
    pool._warned_pinned = False
    return pool, emptied


def test_make_room_empties_the_cache_when_it_holds_more_than_the_device_has_free(monkeypatch) -> None:
    # What the H200 suite showed: 20.6 GiB allocated, 118 GiB reserved and unallocated, 7 MiB free.
    pool, emptied = _pool_on(monkeypatch, free=7 << 20, reserved=139 * GiB, allocated=21 * GiB)
    assert pool.make_room() == 118 * GiB
    assert emptied == [118 * GiB]


def test_make_room_warns_once_of_cache_that_emptying_could_not_give_back(monkeypatch, caplog) -> None:
    """Segments that live blocks pin stay reserved through ``empty_cache``: the capture may fail,
    and the warning names PyTorch's remedy."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pool, emptied = _pool_on(monkeypatch, free=7 << 20, reserved=139 * GiB, allocated=21 * GiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(0))  # gives nothing back
    with caplog.at_level("WARNING", logger="accel.graphs.pool"):
        assert pool.make_room() == 0
        assert pool.make_room() == 0
    (record,) = caplog.records
    assert "118.0 GiB of PyTorch's cache on cuda:0 is held by segments that live tensors pin" in record.message
    assert "expandable_segments:True" in record.message
    assert emptied == [0, 0]


def test_make_room_keeps_the_cache_when_the_device_has_room(monkeypatch) -> None:
    # Emptying it would make every later allocation outside the graphs ask the driver again.
    pool, emptied = _pool_on(monkeypatch, free=80 * GiB, reserved=60 * GiB, allocated=21 * GiB)
    assert pool.make_room() == 0
    assert emptied == []
