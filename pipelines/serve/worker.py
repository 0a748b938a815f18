"""The device worker: the one thread that touches the pipeline.

It builds and warms the engine (so a slow start keeps ``/health`` answering), then takes
batches from the batcher until it closes, one pipeline call each. A call that fails fails its
batch's requests only (each future gets a :class:`BatchFailed` with the cause in one line) and
the worker goes on with the next batch. Pipelines are not thread-safe, so nothing else calls
them; the library serialises calls per scheduler anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

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
    ) -> None:
        super().__init__(name="bcg-serve-device", daemon=True)
        self.batcher = batcher
        self.metrics = metrics
        self._start = start
        self._on_ready = on_ready
        self._on_fatal = on_fatal
        self.engine: Any = None
        self.batches = 0

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
        """One pipeline call for ``batch``; every future gets its images or the failure."""
        m = self.metrics
        t0 = time.monotonic()
        for w in batch:
            m.queue_seconds.observe(t0 - w.arrived)
        images = sum(w.images for w in batch)
        before = self.engine.denoiser_counts()
        try:
            results = self.engine.run([w.plan for w in batch])
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
            self.batches += 1
        after = self.engine.denoiser_counts()
        replays, eager = after[0] - before[0], after[1] - before[1]
        m.pipeline_calls.labels("graphs" if replays else "eager").inc()
        m.denoiser_calls.labels("replay").inc(replays)
        m.denoiser_calls.labels("eager").inc(eager)
        m.images.inc(images)
        m.batch_images.observe(images)
        m.batch_requests.observe(len(batch))
        for w, result in zip(batch, results):
            w.future.set_result(result)
