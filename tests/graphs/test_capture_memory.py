"""A capture's memory: the allocator's cache is given back before a capture that would run short,
and a capture that ran out of memory is tried once more after emptying it.

While a capture runs, PyTorch's caching allocator frees none of its cached segments, so memory
cached outside the graph pool (a compile's autotuning, a model let go) is lost to it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from accel import GraphRunner
from accel.graphs.errors import DeviceMemoryShortError
from accel.graphs.pool import GraphPool
from tests.helpers.fakes import FakeCuda, FakePool

GiB = 1 << 30


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _out_of_memory() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")


def _first_call(fake_cuda: FakeCuda, failures: int, released: int = 0) -> GraphRunner:
    """A runner whose first capture (and ``failures - 1`` more) runs out of memory, where
    emptying the cache gives ``released`` back, after one call; its image is right either way."""
    FakePool.released = released
    fake_cuda.fail_next_capture, fake_cuda.fail_with = failures, _out_of_memory()
    runner = GraphRunner(_scale, name="oom", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    return runner


def test_a_capture_out_of_memory_is_tried_again_after_the_cache_gave_memory_back(fake_cuda: FakeCuda) -> None:
    runner = _first_call(fake_cuda, 1, released=3 * GiB)
    st = runner.stats()
    assert fake_cuda.attempts == 2 and not runner.blocked
    assert (st.captures, st.capture_failures, st.entries, st.eager_calls) == (1, 0, 1, 0)
    y = torch.randn(2, 3)
    assert torch.equal(runner(y), y * 2.0) and runner.stats().replays == 2


def test_a_capture_out_of_memory_is_blocked_when_emptying_the_cache_gives_nothing(fake_cuda: FakeCuda) -> None:
    runner = _first_call(fake_cuda, 1)
    assert fake_cuda.attempts == 1
    (reason,) = runner.blocked.values()
    assert reason.startswith("OutOfMemoryError: CUDA out of memory")
    assert (runner.stats().capture_failures, runner.stats().eager_calls) == (1, 1)


def test_a_capture_is_tried_again_only_once(fake_cuda: FakeCuda) -> None:
    runner = _first_call(fake_cuda, 2, released=3 * GiB)
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


def _pool_on(
    monkeypatch, *, free: int, reserved: int, allocated: int, pinned: int = 0, own_free: int = 0
) -> tuple[GraphPool, list[int]]:
    """A GraphPool over a device whose allocator reports these numbers. Emptying the cache gives
    back what is reserved and not allocated, less ``pinned`` (segments that live blocks keep);
    the device's free memory grows by what it gave back. ``own_free``: free bytes in the pool's
    own segments."""
    state = {"reserved": reserved}
    emptied: list[int] = []

    def empty_cache() -> None:
        given = state["reserved"] - allocated - pinned
        emptied.append(given)
        state["reserved"] -= given

    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (free + reserved - state["reserved"], 140 * GiB)
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    pool = object.__new__(GraphPool)  # no device to take a pool handle and stream on
    pool.device = torch.device("cuda", 0)
    pool._warned_pinned = False
    segments = [{"total_size": own_free + GiB, "allocated_size": GiB}] if own_free else []
    monkeypatch.setattr(pool, "_allocator_segments", lambda: segments)
    return pool, emptied


def test_make_room_empties_the_cache_when_it_holds_more_than_the_device_has_free(monkeypatch) -> None:
    pool, emptied = _pool_on(monkeypatch, free=7 << 20, reserved=139 * GiB, allocated=21 * GiB)
    assert pool.make_room() == 118 * GiB
    assert emptied == [118 * GiB]


def test_make_room_refuses_a_capture_beside_memory_live_tensors_pin(monkeypatch, caplog) -> None:
    """What the H200 suite showed: 20.6 GiB allocated, 118 GiB reserved that emptying the cache
    could not give back, 7 MiB free. No capture is begun (one that runs out of memory midway can
    leave the device unusable); the warning, once, names PyTorch's remedy."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pool, emptied = _pool_on(monkeypatch, free=7 << 20, reserved=139 * GiB, allocated=21 * GiB, pinned=118 * GiB)
    with caplog.at_level("WARNING", logger="accel.graphs.pool"):
        for _ in range(2):
            with pytest.raises(DeviceMemoryShortError) as info:
                pool.make_room()
    assert str(info.value) == (
        "7 MiB of cuda:0 free, 118.0 GiB cached in segments that live tensors (or other graphs) keep: a capture would run out of "
        "memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets PyTorch give it back)"
    )
    (record,) = caplog.records
    assert (
        "118.0 GiB of PyTorch's cache on cuda:0 is held by segments that live tensors (or other graphs) keep"
        in record.message
    )
    assert emptied == [0, 0]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(DeviceMemoryShortError, match=r"out of memory$"):
        pool.make_room()


def test_make_room_counts_the_pools_own_free_segments(monkeypatch, caplog) -> None:
    """A pool's captures overlay: free space in its own segments is room for the next capture,
    and not memory that live tensors pin."""
    pool, _ = _pool_on(
        monkeypatch, free=7 << 20, reserved=40 * GiB, allocated=21 * GiB, pinned=19 * GiB, own_free=19 * GiB
    )
    with caplog.at_level("WARNING", logger="accel.graphs.pool"):
        assert pool.make_room() == 0
    assert not caplog.records


def test_a_refused_capture_blocks_its_signature_and_runs_eagerly(fake_cuda: FakeCuda, monkeypatch) -> None:
    def short(self) -> int:
        raise DeviceMemoryShortError("7 MiB of cuda:0 free: a capture would run out of memory")

    monkeypatch.setattr(FakePool, "make_room", short)
    runner = GraphRunner(_scale, name="short", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    assert fake_cuda.attempts == 0  # no capture begun
    (reason,) = runner.blocked.values()
    assert reason == "DeviceMemoryShortError: 7 MiB of cuda:0 free: a capture would run out of memory"


def test_make_room_keeps_the_cache_when_the_device_has_room(monkeypatch) -> None:
    # Emptying it would make every later allocation outside the graphs ask the driver again.
    pool, emptied = _pool_on(monkeypatch, free=80 * GiB, reserved=60 * GiB, allocated=21 * GiB)
    assert pool.make_room() == 0
    assert emptied == []


def test_a_warm_up_gives_the_cache_back_before_every_capture(monkeypatch) -> None:
    """What the capture's own eager warm-up runs and earlier eager calls left cached would sit
    beside the pool the capture grows: during a warm-up it is given back whatever the room."""
    pool, emptied = _pool_on(monkeypatch, free=80 * GiB, reserved=60 * GiB, allocated=21 * GiB)
    pool.give_back_before_capture = True
    assert pool.make_room() == 39 * GiB and emptied == [39 * GiB]


def test_eager_peaks_are_measured_and_the_process_peak_survives_the_resets(monkeypatch) -> None:
    """measure_eager resets torch's peak counters to read one eager run's peak; peak_memory still
    gives the process's peak across those resets, until reset_peak_memory starts a new window."""
    from accel.graphs import pool as pool_mod

    state = {"allocated": 10 * GiB, "peak": 30 * GiB, "reserved_peak": 40 * GiB, "reserved": 35 * GiB}

    def reset(device=None) -> None:
        state["peak"], state["reserved_peak"] = state["allocated"], state["reserved"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["reserved_peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(pool_mod, "_held_peaks", {})
    pool = object.__new__(GraphPool)
    pool.device = torch.device("cuda", 0)
    for transient in (3 * GiB, 5 * GiB, 2 * GiB):
        with pool.measure_eager():
            state["peak"] = max(state["peak"], state["allocated"] + transient)
    assert pool.take_eager_peak() == 5 * GiB and pool.take_eager_peak() == 0
    assert pool_mod.peak_memory(0) == (30 * GiB, 40 * GiB)  # the process's, from before the resets
    pool_mod.reset_peak_memory(0)
    assert pool_mod.peak_memory(0) == (10 * GiB, 35 * GiB)
