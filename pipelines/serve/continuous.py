"""``--batching continuous``: the device worker that steps running batches, which requests join
and leave at step boundaries.

At each step boundary the worker takes the oldest waiting requests, as many images as the running
batches have rows to spare (the largest bucket in all; with nothing running, after waiting for
company as a dynamic batch does: ``max_wait`` while arrivals are close), and places each in a
running batch of its lane (:mod:`.running`): one with a free slot, where it rides along in a row
that was padding, or a new one at the bucket of the requests joining with it. Its text is
encoded there, in a call of that batch's bucket, and each image gets its own noise (its seed's
generator) and schedule (its own steps). Then one batch takes one step, inside the bracket of a
pipeline call (the accelerator's checks, the adapter of its lane): the batch holding the oldest
request. Rows whose steps are done leave; their images are decoded in a call of their bucket (or
of the smallest bucket that holds them, where the decoder was found to give every row the same
bits at every bucket: :mod:`pipelines.stepwise.invariance`, checked once per size), made 8-bit on
the device as the pipeline call's are, and handed on with their PNG text as
:class:`~.rendered.RenderedImage`, which the service encodes. A request whose client left or whose
time ran out leaves its batch at the next boundary. An edit (its own input image) is one pipeline
call, made between two steps. A failure fails the requests of the batch (or call) it happened in,
and the worker goes on.

Why one batch a step, oldest first, and not every batch at every step: a step's time grows about
linearly with its batch at the sizes served (Z-Image 512x512 on an H100: about 26 ms at batch 1,
184 ms at batch 8), so stepping every batch shares the device among all the requests in flight
and each finishes late, while a request served first come first served finishes in its own
steps' time; joining a batch's free slot is free. docs/serving.md compares the two.

On a GPU the host runs at most one step ahead of the device (it waits for the step before the one
it just queued), so a request that arrives joins at the next boundary, not behind a queue of steps.

Previews (``stream`` with ``partial_images``) are the model's estimate of the clean latents
(:meth:`pipelines.stepwise.schedule.Schedule.x0`) at evenly spaced steps, decoded alone (batch 1,
a graph the warm-up captured); they change nothing of the rows.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pipelines.stepwise.batch import Row, RunningBatch, decode_padded, encode_padded
from pipelines.stepwise.family import call_bracket
from pipelines.stepwise.invariance import decode_is_batch_invariant
from pipelines.stepwise.schedule import Schedule

from .batcher import Work
from .errors import one_line
from .running import Lane, Ticket, lane_of, place, preview_steps
from .worker import BatchFailed, DeviceWorker, RequestGone

__all__ = ["ContinuousWorker"]

logger = logging.getLogger("bcg-serve")


class ContinuousWorker(DeviceWorker):
    """The device worker of ``--batching continuous`` (same start, ready and fatal callbacks as
    :class:`~.worker.DeviceWorker`, whose ``serve`` makes an edit's pipeline call)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[RunningBatch] = []
        self.lanes: dict[int, Lane] = {}  # id(batch) -> its lane
        self.tickets: list[Ticket] = []
        self.rounds = 0
        self._round_done: Any = None  # the device's event at the end of the last step queued
        # Per size: the largest bucket up to which the decoder gives each row the same bits (0: none).
        self._invariant: dict[tuple[int, int], int] = {}

    @property
    def rows(self) -> int:
        return sum(len(b.rows) for b in self.batches)

    def run(self) -> None:
        if not self.started():
            return
        for size in self.engine.warm_sizes or ():  # before the first request, not inside its call
            self._invariant_up_to(size)
        closed = False
        while not (closed and not self.tickets):
            self._drop_gone()  # first: their rows' slots are free for the requests taken now
            if not closed:
                room = self.batcher.max_batch - self.rows
                # Idle, a batch opens with what is taken: it waits for company as a dynamic
                # batch does, or a burst opens small batches whose groups never merge again.
                idle = not self.tickets
                taken = self.batcher.take(room, timeout=None if idle else 0.0, gather=idle)
                if taken is None:
                    closed = True
                else:
                    self._admit(taken)
            self._round()

    # -- joining --------------------------------------------------------------------------------

    def _admit(self, works: list[Work]) -> None:
        now = time.monotonic()
        for w in works:
            w.taken = now
            self.metrics.queue_seconds.observe(now - w.arrived)
        joining = []
        for w in works:
            if w.plan.edit is not None:  # brings its own image: one pipeline call, now
                self.serve([w])
            else:
                joining.append(Ticket(w, lane_of(w.plan)))
        if not joining:
            return
        engine = self.engine
        placed = place(joining, self.batches, self.lanes, engine.bucket, self._limit,
                       lambda lane, bucket: RunningBatch(engine.steps, bucket, (lane[0].width, lane[0].height),
                                                         lane[1]))  # fmt: skip
        for batch in {id(p.batch): p.batch for p in placed if p.opened}.values():
            self.batches.append(batch)
        by_batch: dict[int, list[Ticket]] = {}
        for p in placed:
            p.ticket.batch = p.batch
            p.ticket.work.bucket = p.batch.bucket
            by_batch.setdefault(id(p.batch), []).append(p.ticket)
        for tickets in by_batch.values():
            self._join(tickets)

    def _limit(self, lane: Lane) -> int:
        return self._size_limit((lane[0].width, lane[0].height))

    def _size_limit(self, size: tuple[int, int]) -> int:
        """The most images a batch at ``size`` may have (the memory admission's, at most ``max_batch``)."""
        admission = getattr(self.engine, "admission", None)
        limit = self.batcher.max_batch if admission is None else admission.limit(size)
        return max(1, min(limit, self.batcher.max_batch))

    def _join(self, tickets: list[Ticket]) -> None:
        """``tickets`` (of one batch) encoded at its bucket, their rows in its slots."""
        import torch

        engine, batch = self.engine, tickets[0].batch
        assert batch is not None
        steps = engine.steps
        plans = [t.plan for t in tickets]
        call = plans[0].call
        prompts = [p.request.prompt for p in plans for _ in p.seeds]
        negatives = (
            [p.call.negative_prompt for p in plans for _ in p.seeds] if call.negative_prompt is not None else None
        )
        t0 = time.monotonic()
        try:
            engine.adapters.select(plans[0].request.lora)
            texts = iter(encode_padded(steps, prompts, negatives, batch.cfg, batch.bucket))
            for t in tickets:
                r, c = t.plan.request, t.plan.call
                previews = preview_steps(c.steps, r.partial_images) if r.stream else frozenset()
                for i, seed in enumerate(t.plan.seeds):  # a scheduler per row: each keeps its own step
                    noise = steps.noise(torch.Generator(engine.device).manual_seed(seed), r.width, r.height)
                    schedule = Schedule(steps.scheduler(c.steps, r.width, r.height))
                    t.rows.append(Row(next(texts), noise, schedule, c.guidance or 0.0, previews, (t, i)))
        except Exception as e:
            self._fail(tickets, e, "encoding their text")
            return
        took = time.monotonic() - t0
        for t in tickets:
            t.work.device_seconds += took
            for row in t.rows:
                batch.add(row)
            self.tickets.append(t)

    def _drop_gone(self) -> None:
        for t in [t for t in self.tickets if t.work.gone]:
            for row in t.rows:
                if t.batch is not None:
                    t.batch.remove(row)
            self._forget(t)
            t.work.future.set_exception(RequestGone())

    def _forget(self, ticket: Ticket) -> None:
        if ticket in self.tickets:
            self.tickets.remove(ticket)
        self.batches = [b for b in self.batches if b.rows]
        self.lanes = {id(b): self.lanes[id(b)] for b in self.batches}

    # -- a round of steps -------------------------------------------------------------------------

    def _next(self) -> RunningBatch | None:
        """The batch to step now: the one holding the oldest request (first come, first served)."""
        if not self.tickets:
            return None
        return min(self.tickets, key=lambda t: t.work.arrived).batch

    def _round(self) -> None:
        """One step of the batch whose turn it is (:meth:`_next`); its rows done leave."""
        engine, m = self.engine, self.metrics
        batch = self._next()
        if batch is None:
            return
        mine = [t for t in self.tickets if t.batch is batch]
        lane = self.lanes[id(batch)]
        before = engine.denoiser_counts()
        t0 = self.call_started = time.monotonic()
        try:
            engine.adapters.select(lane[0].lora)
            with call_bracket(engine.pipe):
                previews, done = batch.step()
        except Exception as e:
            self._fail(mine, e, f"a step at batch size {batch.bucket}")
            return
        finally:
            self.call_started = None
        # The wait for the step before counts as this one's: a step's device time, not the host's
        # time to queue it (the first step after another batch's last takes that one's wait).
        self._pace()
        took = time.monotonic() - t0
        after = engine.denoiser_counts()
        replays, eager = after[0] - before[0], after[1] - before[1]
        m.denoiser_calls.labels("replay").inc(replays)
        m.denoiser_calls.labels("eager").inc(eager)
        m.batch_size.observe(batch.bucket)
        m.padded.inc(batch.bucket - len(batch.rows) - len(done))
        for t in mine:
            t.work.device_seconds += took
            t.replayed = t.replayed or replays > 0
        for p in previews:
            self._preview(p)
        self.rounds += 1
        if done:
            self._leave(done)

    def _pace(self) -> None:
        """Wait for the step before the one just queued (a GPU runs asynchronously)."""
        if getattr(self.engine.device, "type", None) != "cuda":
            return
        import torch

        event = torch.cuda.Event()
        event.record()
        if self._round_done is not None:
            self._round_done.synchronize()
        self._round_done = event

    def _leave(self, rows: list[Row]) -> None:
        """Decode the rows done, by size and bucket; answer each request whose rows are all done."""
        groups: dict[tuple[tuple[int, int], int], list[Row]] = {}
        for row in rows:
            ticket = row.owner[0]
            groups.setdefault((ticket.batch.size, ticket.batch.bucket), []).append(row)
        for (size, bucket), group in groups.items():
            tickets = list({id(r.owner[0]): r.owner[0] for r in group}.values())
            t0 = time.monotonic()
            at = self._decode_bucket(size, bucket, len(group))
            try:
                images = self._images(decode_padded(self.engine.steps, [r.latents for r in group], size, at))
            except Exception as e:
                self._fail(tickets, e, f"decoding at batch size {at}")
                continue
            took = time.monotonic() - t0
            made: dict[int, list[Any]] = {}
            for row, image in zip(group, images):
                made.setdefault(id(row.owner[0]), []).append((row.owner[1], image))
            for t in tickets:
                t.work.device_seconds += took
                if len(made[id(t)]) == len(t.rows):
                    self._answer(t, [image for _, image in sorted(made[id(t)], key=lambda x: x[0])])

    def _decode_bucket(self, size: tuple[int, int], bucket: int, rows: int) -> int:
        """The bucket ``rows`` leaving a batch of ``bucket`` at ``size`` decode at: the smallest
        that holds them where every bucket up to ``bucket`` decodes each row to the same bits."""
        smallest = self.engine.bucket(rows)
        return smallest if smallest < bucket <= self._invariant_up_to(size) else bucket

    def _invariant_up_to(self, size: tuple[int, int]) -> int:
        """The largest bucket up to which the decoder gives each row at ``size`` the same bits at
        every bucket, 0 where it does not (found out once per size, up to the largest bucket a
        batch at that size opens at then: :func:`~pipelines.stepwise.invariance.decode_is_batch_invariant`)."""
        if size not in self._invariant:
            top = self.engine.bucket(self._size_limit(size))  # the largest bucket a batch at size opens at
            buckets = [b for b in self.engine.batch_sizes or range(1, top + 1) if b <= top]
            try:
                same = decode_is_batch_invariant(self.engine.steps, size, buckets, self.engine.device)
            except Exception as e:  # an optimisation only: without it rows decode at their batch's bucket
                logger.warning("continuous: the decoder's check at %dx%d failed: %s", *size, one_line(e))
                same = False
            self._invariant[size] = top if same else 0
            logger.info(
                "continuous: the decoder at %dx%d gives each row %s at batch sizes %s: rows leaving a batch decode at %s",
                *size, "the same bits" if same else "other bits", " ".join(map(str, buckets)),
                "the smallest bucket that holds them" if same else "their batch's bucket",
            )  # fmt: skip
        return self._invariant[size]

    def _answer(self, ticket: Ticket, images: list[Any]) -> None:
        engine, m = self.engine, self.metrics
        p = engine.prepared
        ran = p.settings.mode  # as the generation core says it (mode_ran): bcg only where a graph replayed
        if ran == "bcg" and p.accelerated and not ticket.replayed:
            ran = "eager"
        made = engine.made(ticket.plan, images, ran)
        self._forget(ticket)
        m.images.inc(len(made))
        m.device_seconds.observe(ticket.work.device_seconds)
        for _ in made:
            m.image_seconds.observe(ticket.work.device_seconds / len(made))
        if ticket.work.gone:
            ticket.work.future.set_exception(RequestGone())
        else:
            ticket.work.future.set_result(made)

    def _images(self, pixels: Any) -> list[Any]:
        """PIL images of decoded ``(N, 3, H, W)`` pixels, as the pipeline call's are made; NaN refused."""
        from accel import check_pixels, to_pil_images

        found = check_pixels(pixels)
        if not found.finite:
            raise ValueError("the pipeline produced NaN or infinite pixels")
        return to_pil_images(pixels, found)

    def _preview(self, preview: Any) -> None:
        ticket, _ = preview.row.owner
        send = getattr(ticket.work, "partial", None)
        if send is None or ticket.work.gone:
            return
        batch = ticket.batch
        try:
            (image,) = self._images(decode_padded(self.engine.steps, [preview.x0], batch.size, 1))
        except Exception as e:  # a preview is a courtesy: its failure fails nothing
            logger.warning("a preview at step %d could not be made: %s", preview.step + 1, one_line(e))
            return
        send(preview.step, image)

    def _fail(self, tickets: list[Ticket], error: BaseException, where: str) -> None:
        told = one_line(error) if getattr(error, "status", None) == 1 else f"{type(error).__name__}: {one_line(error)}"
        message = f"generation failed: {told[:300]}"
        logger.error("%s for %d request(s) failed: %s", where, len(tickets), message)
        self.metrics.pipeline_calls.labels("failed").inc()
        for t in tickets:
            if t.batch is not None:
                for row in t.rows:
                    t.batch.remove(row)
            self._forget(t)
            if not t.work.future.done():
                t.work.future.set_exception(BatchFailed(message))
