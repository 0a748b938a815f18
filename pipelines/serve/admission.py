"""Memory-aware admission: which batch-size buckets fit the device's memory, at each size.

Before the warm-up, every served size's largest bucket is estimated
(:func:`pipelines.memory_estimate.estimate_activation_bytes`: the VAE decode, the denoiser's
activations, the graph pool of the capture, times a margin); a configuration whose largest call
does not fit the budget is refused in one line naming what to lower (the buckets that fit, the
sizes that fit). The graphs of every bucket share one pool, so the largest call bounds them; the
warm-up measures what they hold (:mod:`.warmup`).

While serving, a call at a (bucket, size) the warm-up captured is admitted (its memory was
measured, and the pool holds it); any other (a size captured on first use, or run eagerly) must
fit what the budget leaves beside the graphs now. A batch larger than what fits is split into
calls of the largest bucket that does (:func:`split`); one that fits at no bucket waits
(:mod:`.worker`). A call that runs out of memory all the same (the estimate was low) is not
lost either: its bucket is marked as not fitting at that size (:meth:`Admission.refuse`) and the
worker makes the same images again in calls of a smaller bucket. Only a single image that runs
out of memory fails its request.

The warm-up measures what each (bucket, size) it ran took (:meth:`Admission.measured`, the
device's peak above what was allocated before the call): where a measurement exists it replaces
the estimate.

The budget is ``--memory-budget``, else the device's free memory once the weights are loaded
(none on a CPU: everything is admitted). Estimates and the budget are plain callables, so the
tests give fake ones.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pipelines.memory_estimate import format_bytes

__all__ = ["Admission", "AdmissionError", "OutOfMemory", "Part", "split"]

logger = logging.getLogger("bcg-serve")

Size = tuple[int, int]
# need(batch, size, graphs): estimated peak bytes of one call; graphs: its capture's pool included.
Need = Callable[[int, Size, bool], int]


class AdmissionError(Exception):
    """A configuration whose largest call cannot fit the budget: one line, exit status 2."""

    status = 2


class OutOfMemory(Exception):
    """A pipeline call of ``images`` images at bucket ``bucket`` and ``size`` ran out of device
    memory (the engine raises it; the worker makes its images again in smaller calls). Its
    message is one line for the client (``status`` 1: told as it is)."""

    status = 1

    def __init__(self, images: int, bucket: int, size: Size) -> None:
        super().__init__(f"out of device memory making {images} image(s) at {_names([size])} in a call of batch "
                         f"{bucket}")  # fmt: skip
        self.images = images
        self.bucket = bucket
        self.size = size


def _names(sizes: Iterable[Size]) -> str:
    return " ".join(f"{w}x{h}" for w, h in sizes)


class Admission:
    """Which buckets fit, at start and per call.

    ``batch_sizes``: the buckets; ``need``: the estimate; ``budget``: bytes the calls and graphs
    may use beyond the weights (None: no limit); ``held``: graph memory held now (measured);
    ``warm``: the (bucket, size) pairs the warm-up captured; ``graphs``: whether a call that was
    not warmed up captures (``--capture-on-miss``).
    """

    def __init__(self, batch_sizes: Sequence[int], need: Need, budget: int | None,
                 held: Callable[[], int] = lambda: 0, graphs: bool = False) -> None:  # fmt: skip
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.need = need
        self.budget = budget
        self.held = held
        self.graphs = graphs
        self.warm: set[tuple[int, Size]] = set()
        self.refused: set[tuple[int, Size]] = set()
        self._measured: dict[tuple[int, Size], int] = {}

    def measured(self, peaks: dict[tuple[int, Size], int]) -> None:
        """Peaks the warm-up measured, by (bucket, size): they replace the estimates, and each is
        logged beside its estimate (how far off the estimate was, for the next configuration)."""
        for (batch, size), peak in sorted(peaks.items()):
            logger.info("memory: batch %d at %s measured %s at its peak (estimated %s)", batch, _names([size]),
                        format_bytes(peak), format_bytes(self.need(batch, size, self.graphs)))  # fmt: skip
        self._measured.update(peaks)

    def bytes_for(self, batch: int, size: Size, graphs: bool) -> int:
        """What a call of ``batch`` at ``size`` needs: measured where the warm-up ran it, else estimated."""
        measured = self._measured.get((batch, size))
        return measured if measured is not None else self.need(batch, size, graphs)

    def refuse(self, bucket: int, size: Size) -> None:
        """``bucket`` ran out of memory at ``size``: no later call there uses it (nor a larger one)."""
        for b in self.batch_sizes:
            if b >= bucket:
                self.refused.add((b, size))
                self.warm.discard((b, size))
        left = [b for b in self.batch_sizes if (b, size) not in self.refused]
        logger.warning("out of memory at batch %d, %s: calls there run at batch sizes %s from now on", bucket,
                       _names([size]), " ".join(map(str, left)) or "none (each image alone fails)")  # fmt: skip

    def check(self, sizes: Sequence[Size], graphs: bool) -> None:
        """AdmissionError, naming what to lower, where the largest bucket at any of ``sizes``
        (captured: ``graphs``) would not fit the budget. Logs each size's estimate."""
        if self.budget is None or not sizes:
            return
        largest = self.batch_sizes[-1]
        too_big = []
        for size in sizes:
            need = self.need(largest, size, graphs)
            logger.info("memory: batch %d at %s needs about %s of the %s budget", largest, _names([size]),
                        format_bytes(need), format_bytes(self.budget))  # fmt: skip
            if need > self.budget:
                too_big.append((size, need))
        if not too_big:
            return
        size, need = max(too_big, key=lambda t: t[1])
        fits = [b for b in self.batch_sizes if self.need(b, size, graphs) <= self.budget]
        sizes_fit = [s for s in sizes if self.need(largest, s, graphs) <= self.budget]
        ways = [f"--batch-sizes {' '.join(map(str, fits))}"] if fits else []
        ways.append(f"--resolutions {_names(sizes_fit)}" if sizes_fit else f"--resolutions below {_names([size])}")
        alone = "" if fits else f" (one image alone needs about {format_bytes(self.need(1, size, graphs))})"
        raise AdmissionError(f"batch {largest} at {_names([size])} needs about {format_bytes(need)} of device memory "
                             f"but the budget is {format_bytes(self.budget)}{alone}: lower to {', or '.join(ways)} "
                             "(or raise --memory-budget)")  # fmt: skip

    def limit(self, size: Size) -> int:
        """The most images one call at ``size`` may have now: the largest bucket that fits (0:
        none does now; the call waits)."""
        allowed = [b for b in reversed(self.batch_sizes) if (b, size) not in self.refused]
        if self.budget is None:
            return allowed[0] if allowed else 1  # nothing known fits: one image at a time, its failure told
        left = self.budget - self.held()
        for b in allowed:
            if (b, size) in self.warm or self.bytes_for(b, size, self.graphs) <= left:
                return b
        return 0

    def key_limit(self, key: Any) -> int:
        """:meth:`limit` for a :class:`~.batcher.BatchKey` (the batcher's ``limit``); at least 1,
        so that the oldest request still leaves the queue (to wait or be split by the worker)."""
        return max(1, self.limit((key.width, key.height)))


@dataclasses.dataclass(frozen=True)
class Part:
    """Images ``start`` to ``stop`` of request ``index`` of a batch."""

    index: int
    start: int
    stop: int


def split(images: Sequence[int], limit: int) -> list[list[Part]]:
    """Calls of at most ``limit`` images for requests of ``images`` images each, in order; a
    request larger than ``limit`` is split across calls (its images keep their seeds)."""
    if limit < 1:
        raise ValueError(f"a call needs room for one image at least, got {limit}")
    calls: list[list[Part]] = [[]]
    room = limit
    for index, n in enumerate(images):
        start = 0
        while start < n:
            if room == 0:
                calls.append([])
                room = limit
            take = min(room, n - start)
            calls[-1].append(Part(index, start, start + take))
            start += take
            room -= take
    return calls
