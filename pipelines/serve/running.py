"""The running batches of ``--batching continuous``: which batch a request's images join, and
what it carries there.

A running batch (:class:`pipelines.stepwise.batch.RunningBatch`) holds rows of one *lane*: one
size, text case, adapter and guidance on or off (:func:`lane_of`: the request's batch key less its
steps and guidance, which are the row's own). Its batch size is a bucket whose graphs the warm-up
captured, fixed while it runs: a row stays in its bucket from its text to its decode, so its image
is the one a pipeline call of that bucket makes of it, bit for bit, whatever shares the batch. A
request's images join one batch together, at a step boundary: the batch of its lane with room for
all of them, else a new batch at the smallest bucket holding the images of its lane that join at
that boundary (at most ``limit``, what the memory admission allows at the size).

Only the device worker's thread uses these (:mod:`.continuous`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipelines.stepwise.batch import Row, RunningBatch

from .batcher import BatchKey, Work

__all__ = ["Lane", "Placement", "Ticket", "lane_of", "place", "preview_steps"]

Lane = tuple[BatchKey, bool]  # the key less steps and guidance, and whether guidance runs


def lane_of(plan: Any) -> Lane:
    """What a request shares with the rows of its running batch."""
    return dataclasses.replace(plan.key, steps=0, guidance=None), bool(plan.call.cfg)


def preview_steps(steps: int, partials: int) -> frozenset[int]:
    """The steps (0-based) whose model estimate is a request's preview: ``partials`` evenly
    spaced over ``steps``, never the last (that is the image); fewer where steps are few."""
    return frozenset(min((k + 1) * steps // (partials + 1), steps - 2) for k in range(partials)) - {-1}


@dataclasses.dataclass(eq=False)
class Ticket:
    """A request in the running batches: its queue entry, its rows (one per image, in seed
    order), the batch they run in and whether a denoiser graph replayed for it."""

    work: Work
    lane: Lane
    rows: list[Row] = dataclasses.field(default_factory=list)
    batch: RunningBatch | None = None
    replayed: bool = False

    @property
    def plan(self) -> Any:
        return self.work.plan


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a request's images go: ``batch`` (new: ``opened``)."""

    ticket: Ticket
    batch: RunningBatch
    opened: bool


def place(tickets: Sequence[Ticket], batches: Sequence[RunningBatch], lanes: dict[int, Lane],
          bucket_for: Callable[[int], int], limit: Callable[[Lane], int],
          open_batch: Callable[[Lane, int], RunningBatch]) -> list[Placement]:  # fmt: skip
    """A batch for each of ``tickets`` (in order): the first of ``batches`` of its lane
    (``lanes``, by ``id`` of the batch) with room for all its images, else a new one
    (``open_batch(lane, bucket)``) at the bucket (``bucket_for``) of the images of its lane still
    to place, at most ``limit(lane)``; a request larger than that gets a bucket of its own size.
    ``lanes`` is updated with the batches opened."""
    out: list[Placement] = []
    free = {id(b): b.free for b in batches}
    every = list(batches)
    for i, t in enumerate(tickets):
        n = t.work.images
        batch = next((b for b in every if lanes[id(b)] == t.lane and free[id(b)] >= n), None)
        opened = batch is None
        if batch is None:
            waiting = sum(u.work.images for u in tickets[i:] if u.lane == t.lane)
            batch = open_batch(t.lane, bucket_for(max(n, min(waiting, limit(t.lane)))))
            lanes[id(batch)] = t.lane
            free[id(batch)] = batch.free
            every.append(batch)
        free[id(batch)] -= n
        out.append(Placement(t, batch, opened))
    return out
