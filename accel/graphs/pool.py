"""A CUDA-graph memory pool and capture stream that several graph runners share.

All segments of all captured signatures of all denoisers of a pipeline allocate from one pool:
only one graph replays at a time, so their intermediates can overlay. The pool also serialises
replays (a lock for threads, an event for streams), because two graphs replaying at once would
write the same blocks.

Memory accounting: a capture's eager warm-up runs measure the most they allocate above what was
allocated when they began (:meth:`GraphPool.measure_eager`), the transient peak of the call the
graph replaces. That takes resetting torch's peak counters of the device; what they held before is
kept here, so :func:`peak_memory` still gives the process's peak across those resets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .errors import BCGError, DeviceMemoryShortError

__all__ = ["GraphPool", "peak_memory", "reset_peak_memory"]

logger = logging.getLogger(__name__)

# Cached memory that emptying the cache could not give back, above which a capture is warned of.
PINNED_WARNING_BYTES = 4 << 30
# Free device memory below which no capture is begun (a capture's pool takes new segments for
# every intermediate: far more than this for any denoiser).
MIN_FREE_TO_CAPTURE = 256 << 20

# Per device index: the (allocated, reserved) peaks torch's counters held before this module reset
# them to measure an eager run.
_held_peaks: dict[int, tuple[int, int]] = {}


def _index(device: torch.device | str | int | None) -> int:
    if isinstance(device, int):
        return device
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def peak_memory(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """The most bytes allocated and reserved on ``device`` since :func:`reset_peak_memory` (or the
    process's start): torch's peak counters, with what they held before the pools reset them."""
    index = _index(device)
    held = _held_peaks.get(index, (0, 0))
    return (
        max(torch.cuda.max_memory_allocated(index), held[0]),
        max(torch.cuda.max_memory_reserved(index), held[1]),
    )


def reset_peak_memory(device: torch.device | str | int | None = None) -> None:
    """Start :func:`peak_memory`'s window now (torch's counters and the ones held here)."""
    index = _index(device)
    _held_peaks.pop(index, None)
    torch.cuda.reset_peak_memory_stats(index)


def _hold_peaks(index: int) -> None:
    """Keep torch's current peaks of the device before they are reset."""
    _held_peaks[index] = peak_memory(index)


class GraphPool:
    """One graph memory pool, capture stream and replay lock on one CUDA device.

    Attributes:
        give_back_before_capture: set by a warm-up: the allocator's cache is given back before
            every capture (see :meth:`make_room`).
        eager_peak: the largest transient peak :meth:`measure_eager` measured since
            :meth:`take_eager_peak`.
    """

    give_back_before_capture: bool = False
    eager_peak: int = 0

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BCGError("GraphPool needs a CUDA device; none is available")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"GraphPool needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        with torch.cuda.device(device):
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)
        self.lock = threading.RLock()
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._last_replay_stream: torch.cuda.Stream | None = None
        self._last_replay_done = torch.cuda.Event()
        self._warned_pinned = False

    def handle_for(self, graph: Any) -> Any:
        """The pool handle to capture ``graph`` into, registering it as a user of the pool.

        Torch frees a private pool once the last graph using it is gone, and a freed pool's
        handle cannot take new captures. When no registered graph holds segments any more
        (all were released, evicted, invalidated or failed), a fresh handle is taken.
        """
        if not any(g.num_segments for g in self._graphs):
            with torch.cuda.device(self.device):
                self.handle = torch.cuda.graph_pool_handle()
        self._graphs.add(graph)
        return self.handle

    def make_room(self) -> int:
        """Give the allocator's cached segments back to the device when they are more than it has
        free; call before a capture. Returns the bytes given back.

        A capture allocates from this pool alone, and while it runs the caching allocator frees
        none of its cached segments (cudaFree cannot be captured): free memory that the default
        pool caches (a model let go, the peak of an earlier call) is lost to the capture unless it
        is given back first. What a live block pins cannot be given back at all; that is said
        once, with PyTorch's remedy. (Nor can anything while the allocator counts an earlier,
        failed capture as under way: :mod:`accel.graphs.bcg` ends that.) DeviceMemoryShortError,
        and no capture begun, where too little would be left for one: a capture that runs out of
        memory midway can leave the device unusable.

        With :attr:`give_back_before_capture` (a warm-up sets it) the cache is given back before
        every capture: it holds the transient of the capture's own eager warm-up runs (on the
        capture stream) and of earlier eager calls, dead weight beside the pool the capture grows,
        which would otherwise add to the process's peak. Elsewhere (a capture on first use) the
        cache is kept where the device has room: emptying it makes later allocations outside the
        graphs ask the driver again.
        """
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if cached <= free and free >= MIN_FREE_TO_CAPTURE and not self.give_back_before_capture:
            return 0
        released = 0
        if cached > free or self.give_back_before_capture:
            released = self.release_cached()
            cached -= released
            free, _ = torch.cuda.mem_get_info(self.device)
        own = self.free_in_pool()  # the capture allocates there first
        pinned = max(0, cached - own)
        if pinned > max(free, PINNED_WARNING_BYTES) and not self._warned_pinned:
            self._warned_pinned = True
            logger.warning(
                "%.1f GiB of PyTorch's cache on %s is held by segments that live tensors (or other graphs) keep, beside %.1f GiB "
                "free: graph captures may run out of memory and run eagerly%s",
                pinned / 2**30,
                self.device,
                free / 2**30,
                _remedy(),
            )
        if free + own < MIN_FREE_TO_CAPTURE:
            held = (
                f", {pinned / 2**30:.1f} GiB cached in segments that live tensors (or other graphs) keep"
                if pinned
                else ""
            )
            raise DeviceMemoryShortError(
                f"{free / 2**20:.0f} MiB of {self.device} free{held}: a capture would run out of memory{_remedy()}"
            )
        return released

    @contextlib.contextmanager
    def measure_eager(self) -> Iterator[None]:
        """Around eager runs of a call (a capture's warm-up runs): the most they allocate on the
        device above what was allocated when they began is kept in :attr:`eager_peak` (the
        largest since :meth:`take_eager_peak`)."""
        index = _index(self.device)
        _hold_peaks(index)
        torch.cuda.reset_peak_memory_stats(index)
        start = torch.cuda.memory_allocated(index)
        try:
            yield
        finally:
            self.eager_peak = max(self.eager_peak, torch.cuda.max_memory_allocated(index) - start)

    def take_eager_peak(self) -> int:
        """The largest eager peak measured since the last call (0 if none), and start again."""
        peak, self.eager_peak = self.eager_peak, 0
        return peak

    def free_in_pool(self) -> int:
        """Free bytes in this pool's segments, which its next capture can take without asking the device."""
        return sum(s["total_size"] - s["allocated_size"] for s in self._allocator_segments())

    def release_cached(self) -> int:
        """Empty the allocator's cache on this device; returns the bytes it gave back."""
        before = torch.cuda.memory_reserved(self.device)
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved(self.device))

    def order_after_last_replay(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for the last replay if that ran on another stream (no host sync).

        Call with :attr:`lock` held, before a replay.
        """
        if self._last_replay_stream is not None and self._last_replay_stream != stream:
            stream.wait_event(self._last_replay_done)

    def mark_replay_done(self, stream: torch.cuda.Stream) -> None:
        """Record that the last replay's work (including the output copy) was issued on ``stream``."""
        self._last_replay_stream = stream
        self._last_replay_done.record(stream)

    def _allocator_segments(self) -> list[dict]:
        """The caching allocator's segments (not graph segments) that belong to this pool."""
        pool = tuple(self.handle)
        return [
            s
            for s in torch.cuda.memory._snapshot(self.device)["segments"]  # type: ignore[attr-defined]
            if tuple(s.get("segment_pool_id", ())) == pool and s.get("device", self.device.index) == self.device.index
        ]

    def resident_bytes(self) -> int:
        """Device memory the pool holds (reserved segments), whether or not a graph uses it now."""
        return sum(s["total_size"] for s in self._allocator_segments())

    def __repr__(self) -> str:
        return f"GraphPool(device={self.device}, handle={tuple(self.handle)})"


def _remedy() -> str:
    """PyTorch's answer to memory that segments with a live block in them keep reserved: only
    expandable segments unmap their free pages."""
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return ""
    return " (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets PyTorch give it back)"
