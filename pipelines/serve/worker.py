"""The device worker: the one thread that touches the pipeline.

It builds and warms the engine (so a slow start keeps ``/health`` answering), then takes
batches from the batcher until it closes. A batch is one pipeline call, unless the memory
admission (:mod:`.admission`) admits fewer images at its size now: then it is split into calls
of the largest bucket that fits, each request's images kept in order; where no bucket fits now,
it waits for memory (at most ``admission_wait`` seconds, then its requests fail). A call that
runs out of memory all the same is made again in calls of a smaller bucket (its bucket refused
at that size from then on), so its requests lose nothing; only one image at the smallest bucket
that runs out of memory fails. A call that fails fails its batch's requests only (each future
gets a :class:`BatchFailed` with the cause in one line) and the worker goes on with the next
batch. Pipelines are not thread-safe, so nothing else calls them; the library serialises calls
per scheduler anyway.

A request that gives up while its batch runs (its ``--timeout`` passed, its client left) is marked
``gone``: nothing more is made for it, and a call whose requests are all gone stops at the end of
its current denoising step (diffusers' ``callback_on_step_end``; :class:`~pipelines.generation.StepWatch`),
so the device is free for the requests behind it within one step, not one whole call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pipelines.generation import CallStopped

from .admission import OutOfMemory, split
from .batcher import Batcher, Work
from .errors import one_line
from .metrics import Metrics

__all__ = ["BatchFailed", "DeviceWorker", "RequestGone"]

logger = logging.getLogger("bcg-serve")


class BatchFailed(Exception):
    """The pipeline call that computed this request failed (answered 500)."""


class RequestGone(Exception):
    """The request gave up before its images were made: nothing was made for it (it was answered already)."""


class DeviceWorker(threading.Thread):
    """Runs ``start()`` (which returns the engine), then serves batches.

    ``on_ready(engine)`` is called once the engine exists and is warm; ``on_fatal(error)`` with
    what ``start`` raised, if it did (the server then exits). The thread is a daemon: a server told to stop
    while a model still loads does not wait for the load.
    """

    def __init__(
        self,
        batcher: Batcher,
        metrics: Metrics,
        start: Callable[[], Any],
        on_ready: Callable[[Any], None],
        on_fatal: Callable[[BaseException], None],
        admission_wait: float = 300.0,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(name="bcg-serve-device", daemon=True)
        self.batcher = batcher
        self.metrics = metrics
        self._start = start
        self._on_ready = on_ready
        self._on_fatal = on_fatal
        self._on_lost = on_lost
        self.engine: Any = None
        self.batches = 0
        self.admission_wait = admission_wait
        # time.monotonic() when the pipeline call under way began (None: none is): /ready reads it.
        self.call_started: float | None = None
        self._poll = 0.05  # seconds between looks at the memory while a batch waits for it

    def run(self) -> None:
        if self.started():
            try:
                while (batch := self.batcher.next_batch()) is not None:
                    self.serve(batch)
            finally:
                close = getattr(self.engine, "close", None)
                if close is not None:
                    close()  # --parallel: the other ranks exit

    def started(self) -> bool:
        """The engine built and warmed up on this thread (``on_ready`` told); False where the start
        failed (``on_fatal`` told its reason, which ends the server)."""
        try:
            engine = self._start()
        except BaseException as e:
            self._on_fatal(e)
            return False
        self.engine = engine
        self._on_ready(engine)
        return True

    def serve(self, batch: list[Work]) -> None:
        """``batch``'s pipeline call(s); every future gets its images or the failure."""
        m = self.metrics
        t0 = time.monotonic()
        for w in batch:
            w.taken = t0
            m.queue_seconds.observe(t0 - w.arrived)
        results: list[list[Any]] = [[] for _ in batch]
        device = [0.0] * len(batch)  # seconds of the pipeline calls that made each request's images
        try:
            self._compute(batch, results, device)
        except Exception as e:  # one batch's failure is that batch's alone
            images = sum(w.images for w in batch)
            m.pipeline_calls.labels("failed").inc()
            # The generation core's errors are one line for users already (out of memory, NaN pixels,
            # a refused call).
            reason = one_line(e) if getattr(e, "status", None) == 1 else f"{type(e).__name__}: {one_line(e)}"
            message = f"generation failed: {reason[:300]}"
            logger.error("a batch of %d request(s), %d image(s), %s", len(batch), images, message)
            for w in batch:
                w.future.set_exception(BatchFailed(message))
            lost = getattr(self.engine, "lost", None)
            if lost is not None and self._on_lost is not None:  # --parallel: a rank is gone, no call can run
                self._on_lost(lost)
            return
        finally:
            m.observe_batch(time.monotonic() - t0)
            for w, seconds in zip(batch, device):
                w.device_seconds = seconds
                m.device_seconds.observe(seconds)
            self.batches += 1
        made = [w for w, result in zip(batch, results) if len(result) == w.images]
        if made:
            m.images.inc(sum(w.images for w in made))
            m.batch_images.observe(sum(w.images for w in made))
            m.batch_requests.observe(len(made))
        for w, result in zip(batch, results):
            if len(result) == w.images:
                w.future.set_result(result)
            else:  # gone before all its images were made: what was made is dropped
                w.future.set_exception(RequestGone())

    def _compute(self, batch: list[Work], results: list[list[Any]], device: list[float]) -> None:
        """Every image of ``batch`` into ``results``, in calls of what the admission admits now:
        one call if it all fits; after an out-of-memory call, the images it had again, smaller.
        Each call's seconds are added to ``device`` for every request it had images of."""
        done = [0] * len(batch)  # images of each request made so far
        while left := [(i, d) for i, (d, w) in enumerate(zip(done, batch)) if d < w.images and not w.gone]:
            limit = self._admitted(batch[left[0][0]])
            call = split([batch[i].images - d for i, d in left], limit)[0]
            parts = [(left[p.index][0], left[p.index][1] + p.start, left[p.index][1] + p.stop) for p in call]
            plans = [_part(batch[i].plan, start, stop) for i, start, stop in parts]
            waiting = [batch[i] for i in {i for i, _, _ in parts}]
            t0 = time.monotonic()
            try:
                made = self._call(plans, functools.partial(_all_gone, waiting))
            except CallStopped as e:
                self.metrics.pipeline_calls.labels("stopped").inc()
                key = batch[left[0][0]].key
                logger.info("a call of %d image(s) at %dx%d stopped after step %d of %d: its request(s) gave up",
                            sum(len(p.seeds) for p in plans), key.width, key.height, e.step, key.steps)  # fmt: skip
                continue
            except OutOfMemory as e:
                admission = getattr(self.engine, "admission", None)
                if admission is None or e.bucket <= admission.batch_sizes[0]:
                    raise  # one image at the smallest bucket: nothing smaller to try
                admission.refuse(e.bucket, e.size)
                self.metrics.pipeline_calls.labels("out_of_memory").inc()
                continue
            finally:
                took = time.monotonic() - t0
                for i in {i for i, _, _ in parts}:
                    device[i] += took
            for (i, _, stop), images in zip(parts, made):
                results[i].extend(images)
                done[i] = stop

    def _call(self, plans: list[Any], stop: Callable[[], bool]) -> list[list[Any]]:
        """One pipeline call, counted: what ran, its bucket and padding, its seconds per image.
        ``stop``: whether every request the call is for has given up (asked after each step)."""
        m, engine = self.metrics, self.engine
        images = sum(len(p.seeds) for p in plans)
        before = engine.denoiser_counts()
        t0 = self.call_started = time.monotonic()
        try:
            out = engine.make(plans, stop)  # encoded on the service's encoding threads: the device goes on
        finally:
            self.call_started = None
        seconds = time.monotonic() - t0
        after = engine.denoiser_counts()
        replays, eager = after[0] - before[0], after[1] - before[1]
        m.pipeline_calls.labels("graphs" if replays else "eager").inc()
        m.denoiser_calls.labels("replay").inc(replays)
        m.denoiser_calls.labels("eager").inc(eager)
        bucket = engine.bucket(images)
        m.batch_size.observe(bucket)
        m.padded.inc(bucket - images)
        for _ in range(images):
            m.image_seconds.observe(seconds / images)
        return out

    def _admitted(self, head: Work) -> int:
        """The most images a call of ``head``'s key may have now, waiting while none fits."""
        admission = getattr(self.engine, "admission", None)
        if admission is None:
            return self.batcher.max_batch
        size = (head.key.width, head.key.height)
        give_up = time.monotonic() + self.admission_wait
        said = False
        while (limit := admission.limit(size)) < 1:
            if not said:
                logger.warning("a call at %dx%d waits for device memory (no batch size fits what is free now)", *size)
                said = True
            if time.monotonic() > give_up:
                raise MemoryError(f"no device memory for one image at {size[0]}x{size[1]} within "
                                  f"{self.admission_wait:g} s")  # fmt: skip
            time.sleep(self._poll)
        return min(limit, self.batcher.max_batch)


def _all_gone(works: list[Work]) -> bool:
    return all(w.gone for w in works)


def _part(plan: Any, start: int, stop: int) -> Any:
    """``plan`` for its images ``start`` to ``stop`` only (their seeds kept)."""
    if start == 0 and stop == len(plan.seeds):
        return plan
    return dataclasses.replace(plan, seeds=plan.seeds[start:stop])
