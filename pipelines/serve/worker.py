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
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .admission import OutOfMemory, split
from .batcher import Batcher, Work
from .errors import one_line
from .metrics import Metrics

__all__ = ["BatchFailed", "DeviceWorker"]

logger = logging.getLogger("bcg-serve")


class BatchFailed(Exception):
    """The pipeline call that computed this request failed (answered 500)."""


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
    ) -> None:
        super().__init__(name="bcg-serve-device", daemon=True)
        self.batcher = batcher
        self.metrics = metrics
        self._start = start
        self._on_ready = on_ready
        self._on_fatal = on_fatal
        self.engine: Any = None
        self.batches = 0
        self.admission_wait = admission_wait
        self._poll = 0.05  # seconds between looks at the memory while a batch waits for it

    def run(self) -> None:
        try:
            engine = self._start()
        except BaseException as e:  # a failed start ends the server, with its reason
            self._on_fatal(e)
            return
        self.engine = engine
        self._on_ready(engine)
        while (batch := self.batcher.next_batch()) is not None:
            self.serve(batch)

    def serve(self, batch: list[Work]) -> None:
        """``batch``'s pipeline call(s); every future gets its images or the failure."""
        m = self.metrics
        t0 = time.monotonic()
        for w in batch:
            m.queue_seconds.observe(t0 - w.arrived)
        images = sum(w.images for w in batch)
        results: list[list[Any]] = [[] for _ in batch]
        device = [0.0] * len(batch)  # seconds of the pipeline calls that made each request's images
        try:
            self._compute(batch, results, device)
        except Exception as e:  # one batch's failure is that batch's alone
            m.pipeline_calls.labels("failed").inc()
            # The CLI's errors are told for users already (out of memory, NaN pixels, a refused call).
            told = one_line(e) if getattr(e, "status", None) == 1 else f"{type(e).__name__}: {one_line(e)}"
            message = f"generation failed: {told[:300]}"
            logger.error("a batch of %d request(s), %d image(s), %s", len(batch), images, message)
            for w in batch:
                w.future.set_exception(BatchFailed(message))
            return
        finally:
            m.observe_batch(time.monotonic() - t0)
            for seconds in device:
                m.device_seconds.observe(seconds)
            self.batches += 1
        m.images.inc(images)
        m.batch_images.observe(images)
        m.batch_requests.observe(len(batch))
        for w, result in zip(batch, results):
            w.future.set_result(result)

    def _compute(self, batch: list[Work], results: list[list[Any]], device: list[float]) -> None:
        """Every image of ``batch`` into ``results``, in calls of what the admission admits now:
        one call if it all fits; after an out-of-memory call, the images it had again, smaller.
        Each call's seconds are added to ``device`` for every request it had images of."""
        done = [0] * len(batch)  # images of each request made so far
        while any(d < w.images for d, w in zip(done, batch)):
            left = [(i, d) for i, (d, w) in enumerate(zip(done, batch)) if d < w.images]
            limit = self._admitted(batch[0])
            call = split([batch[i].images - d for i, d in left], limit)[0]
            parts = [(left[p.index][0], left[p.index][1] + p.start, left[p.index][1] + p.stop) for p in call]
            plans = [_part(batch[i].plan, start, stop) for i, start, stop in parts]
            t0 = time.monotonic()
            try:
                made = self._call(plans)
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

    def _call(self, plans: list[Any]) -> list[list[Any]]:
        """One pipeline call, counted: what ran, its bucket and padding, its seconds per image."""
        m, engine = self.metrics, self.engine
        images = sum(len(p.seeds) for p in plans)
        before = engine.denoiser_counts()
        t0 = time.monotonic()
        out = engine.make(plans)  # encoded on the service's encoding threads: the device goes on
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


def _part(plan: Any, start: int, stop: int) -> Any:
    """``plan`` for its images ``start`` to ``stop`` only (their seeds kept)."""
    if start == 0 and stop == len(plan.seeds):
        return plan
    return dataclasses.replace(plan, seeds=plan.seeds[start:stop])
