"""The service behind the routes: its phase, and one request's way through the queue.

A generation request is planned by the engine, queued, and waited on until the first of: its
images, its client leaving, or ``timeout`` seconds since it arrived. A request that gives up
while still queued is taken out and never computed; one whose batch already runs is marked gone:
the device worker makes nothing more for it, and a call that only gone requests wait for stops at
its next step's end. The device worker hands on images, not files: a request's
files are encoded here, on a thread of the service's encoding pool that the hand-over itself sets
going (not through the event loop), while the device makes the next call.

Phases: ``starting`` (model loading and warm-up; generation answers 503), ``ready``,
``stopping`` (after SIGTERM: nothing new is queued, what waited is answered 503, the running
batch finishes), ``failed`` (the start failed; the server exits), ``lost`` (``--parallel``: a
rank is gone; every request is answered 503 and ``/health`` too, so that it is restarted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import Histogram

from .batcher import Batcher, Closed, QueueFull, Work
from .continuous import ContinuousWorker
from .errors import ServeError, one_line
from .metrics import Metrics
from .rendered import EncodedImage, RenderedImage
from .schema import ImageRequest, Served
from .streaming import ImageStream
from .worker import BatchFailed, DeviceWorker

__all__ = ["Service", "encode_timed"]

logger = logging.getLogger("bcg-serve")

Receive = Callable[[], Awaitable[dict[str, Any]]]


class Service:
    """What the routes ask: ``phase``, ``served``, ``metrics``, ``engine`` and :meth:`generate`.

    ``start`` builds the engine on the device worker's thread (see :class:`DeviceWorker`).
    """

    def __init__(self, served: Served, batcher: Batcher, start: Callable[[], Any], timeout: float,
                 batching: str = "dynamic") -> None:  # fmt: skip
        self.served = served
        self.batcher = batcher
        self.timeout = timeout
        self.metrics = Metrics(batcher.max_batch, lambda: batcher.depth, served.batch_sizes or None)
        self.phase = "starting"
        self.fatal: str | None = None
        self.fatal_status = 0
        self.engine: Any = None
        self.started = time.time()
        worker = ContinuousWorker if batching == "continuous" else DeviceWorker
        self.lost: str | None = None  # --parallel: why the ranks can serve no more
        self.worker = worker(batcher, self.metrics, start, self._ready, self._failed, admission_wait=timeout,
                             on_lost=self._lost)  # fmt: skip
        # Where the files are encoded (:meth:`encode_when_made`); as many threads as asyncio's own pool.
        self._encoder = concurrent.futures.ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4),
                                                              thread_name_prefix="bcg-serve-encode")  # fmt: skip

    def start(self) -> None:
        self.worker.start()

    def _ready(self, engine: Any) -> None:
        self.engine = engine
        warm = getattr(engine, "warm_sizes", None)
        if warm is not None:  # graphs were captured: only their sizes are served (no --capture-on-miss)
            cold = tuple(s for s in self.served.sizes if s not in warm)
            self.served = dataclasses.replace(self.served, sizes=tuple(warm), cold=cold)
            if cold:
                logger.info("not warmed up, so not served: %s (--capture-on-miss serves them)",
                            ", ".join(f"{w}x{h}" for w, h in cold))  # fmt: skip
        admission = getattr(engine, "admission", None)
        if admission is not None:
            self.batcher.limit = admission.key_limit
        for batch, cost in getattr(engine, "warmup_costs", {}).items():
            self.metrics.warmup_seconds.labels(str(batch)).set(cost.seconds)
        if hasattr(engine, "graph_memory_bytes"):
            # Read when /metrics is scraped, never per batch: it snapshots the allocator, which
            # took milliseconds that every request waited for.
            self.metrics.graph_memory.set_function(engine.graph_memory_bytes)
        if self.phase == "starting":
            self.phase = "ready"
            self.metrics.ready.set(1)
            logger.info("ready: serving %s at %s, batch sizes %s", self.served.model, ", ".join(self.served.size_names),
                        " ".join(map(str, self.served.batch_sizes or (self.batcher.max_batch,))))  # fmt: skip

    def _failed(self, error: BaseException) -> None:
        # The generation core's errors are one line for users already, and carry their exit status.
        status = getattr(error, "status", None)
        reason = one_line(error) if isinstance(status, int) else f"{type(error).__name__}: {one_line(error)}"
        self.fatal = reason
        self.fatal_status = status if isinstance(status, int) else 1
        self.phase = "failed"
        logger.error("could not start: %s", reason)

    def _lost(self, reason: str) -> None:
        """The ranks of ``--parallel`` can make no more calls: what waits is answered 503 now, and
        every request after it."""
        if self.lost is not None:
            return
        self.lost = reason
        was = self.phase
        self.phase = "lost"
        waiting = self._answer_waiting()
        logger.error("cannot serve any more (%s): %d waiting request(s) answered 503%s", reason, len(waiting),
                     "; stop and restart the server" if was == "ready" else "")  # fmt: skip

    def _answer_waiting(self) -> list[Any]:
        """Not ready, the queue closed, and every request still waiting answered 503 (returned)."""
        self.metrics.ready.set(0)
        waiting = self.batcher.close()
        for w in waiting:
            w.future.set_exception(Closed())
        self.metrics.dropped.labels("shutdown").inc(len(waiting))
        return waiting

    def stop(self) -> None:
        """Stop accepting; the waiting requests are answered 503 now, the running batch finishes."""
        if self.phase in ("stopping", "failed", "lost"):
            return
        self.phase = "stopping"
        waiting = self._answer_waiting()
        logger.info("stopping: %d waiting request(s) answered 503; the running batch finishes", len(waiting))

    def busy(self) -> tuple[str, str] | None:
        """Why a request would not be taken now, as (code, reason); None when it would: ready, its
        device worker alive, room in the queue, and no pipeline call running past ``timeout``
        (one that cannot be stopped at a step: a pipeline without a step callback, or one step
        longer than the timeout)."""
        if self.phase != "ready":
            return self.phase, self.phase
        if not self.worker.is_alive():
            return "worker_stopped", "the device worker has stopped"
        if self.batcher.depth >= self.batcher.max_queue:
            return "queue_full", f"the queue is full ({self.batcher.max_queue} requests waiting)"
        started = self.worker.call_started
        if started is not None and time.monotonic() - started > self.timeout:
            return (
                "busy",
                f"a pipeline call has run {time.monotonic() - started:.0f} s, past --timeout {self.timeout:g}",
            )
        return None

    def retry_after(self) -> int:
        """Seconds a client told 429 should wait: about what the queue ahead needs."""
        mean = self.metrics.mean_batch_seconds
        per_batch = 1.0 if math.isnan(mean) else mean
        return max(1, math.ceil(per_batch * (self.batcher.depth / self.batcher.max_batch + 1)))

    def _unavailable(self) -> ServeError:
        if self.phase == "starting":
            return ServeError(503, "the server is warming up (GET /ready says when it is done)", code="warming_up",
                              headers={"Retry-After": "5"})  # fmt: skip
        if self.phase == "lost":
            return ServeError(503, f"the server cannot serve any more: {self.lost}", code="ranks_lost")
        return ServeError(503, "the server is stopping", code="shutting_down")

    async def generate(self, request: ImageRequest, receive: Receive, arrived: float,
                       access: dict[str, Any] | None = None) -> list[EncodedImage]:  # fmt: skip
        """The images of ``request``, or :class:`ServeError` (400, 429, 500, 503, 504, or 499 for
        a client that left). ``receive`` is the ASGI receive of the request, its body read;
        ``arrived`` its ``time.monotonic()`` arrival. ``access``: the request's access-log fields,
        given its steps and, however it ends, its seconds in the queue, on the device and encoding."""
        work = self.submit(request, arrived, access)
        encoded = self.encode_when_made(work)
        result = asyncio.wrap_future(encoded)
        result.add_done_callback(_consume)
        gone = asyncio.ensure_future(_disconnected(receive))
        left = self.timeout - (time.monotonic() - arrived)
        try:
            done, _ = await asyncio.wait({result, gone}, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if result in done or _made(work):  # its images came in time: it is answered, their files encoded
            try:
                return await result
            except BatchFailed as e:
                raise ServeError(500, str(e), code="generation_failed") from None
            except Closed:
                raise self._unavailable() from None
        reason = "disconnected" if gone in done else "timeout"
        self.give_up(work, reason)
        encoded.cancel()  # its images, if its batch runs already, are not encoded
        if reason == "disconnected":
            raise ServeError(499, "the client closed the connection", code="client_closed")
        raise ServeError(504, f"not done within --timeout {self.timeout:g} s; the request was dropped",
                         code="timeout")  # fmt: skip

    async def stream(self, request: ImageRequest, receive: Receive, arrived: float,
                     access: dict[str, Any] | None = None) -> ImageStream:  # fmt: skip
        """``request`` queued, to be answered as its events (:class:`~.streaming.ImageStream`);
        ServeError where it cannot be (400, 429, 503). ``receive`` is unread here: the answer's
        own iteration sees its client leave."""
        return ImageStream(self, request, arrived, access)

    def submit(self, request: ImageRequest, arrived: float, access: dict[str, Any] | None = None,
               partial: Callable[[int, Any], None] | None = None) -> Work:  # fmt: skip
        """``request`` planned and queued (its previews to ``partial``, where it streams); ServeError
        where it cannot be (400, 429, 503)."""
        if self.phase != "ready":
            raise self._unavailable()
        plan = self.engine.plan(request)
        work = Work(plan.key, request.n, plan, arrived=arrived, partial=partial)
        if access is not None:
            access["steps"] = plan.call.steps
            access["work"] = work
        try:
            self.batcher.submit(work)
        except QueueFull:
            raise ServeError(429, f"the queue is full ({self.batcher.max_queue} requests waiting); retry later",
                             code="queue_full", headers={"Retry-After": str(self.retry_after())}) from None  # fmt: skip
        except Closed:
            raise self._unavailable() from None
        return work

    def give_up(self, work: Work, reason: str) -> None:
        """``work`` is no longer waited for (``reason``: disconnected, timeout): out of the queue
        if it is still there, else nothing more is made for it."""
        work.gone = True  # before the cancel: a batch that takes it meanwhile makes nothing for it
        if self.batcher.cancel(work):
            self.metrics.dropped.labels(reason).inc()
        else:
            self.metrics.dropped.labels(f"{reason}_running").inc()

    def encode_later(self, made: RenderedImage) -> concurrent.futures.Future:
        """``made``'s file, encoded on the service's encoding threads."""
        return self._encoder.submit(made.encode)

    def encode_when_made(self, work: Work) -> concurrent.futures.Future:
        """The files of ``work``'s images, or its failure: encoded on the service's encoding
        threads as soon as the device worker hands the images on.

        The worker's hand-over submits the encoding itself, so the images do not wait for the
        event loop to wake up and pass them on, nor the loop for the encoding to start. Off the
        event loop and off the device worker: zlib releases the GIL, so one request's encoding
        overlaps the next call and other requests' encoding. Cancelling the returned future (as
        asyncio does with the task that waits on it) cancels ``work`` too, if it is still queued,
        and images made after it are not encoded."""
        encoded: concurrent.futures.Future = concurrent.futures.Future()
        seconds = self.metrics.encode_seconds

        def encode(made: list[RenderedImage]) -> None:
            if not encoded.set_running_or_notify_cancel():
                return  # the request gave up before its turn came
            t0 = time.monotonic()
            try:
                files = encode_timed(made, seconds)
                work.encode_seconds = time.monotonic() - t0
                encoded.set_result(files)
            except BaseException as e:  # told to the route, which answers 500
                encoded.set_exception(e)

        def handed_on(future: concurrent.futures.Future) -> None:  # on the device worker's thread
            if future.cancelled():
                encoded.cancel()
                return
            error = future.exception()
            if error is None:
                try:
                    self._encoder.submit(encode, future.result())
                    return
                except RuntimeError as e:  # the interpreter is exiting: no new threads
                    error = e
            if encoded.set_running_or_notify_cancel():
                encoded.set_exception(error)

        def given_up(future: concurrent.futures.Future) -> None:
            if future.cancelled():
                work.future.cancel()  # only while it waits in the queue (the batcher drops it)

        encoded.add_done_callback(given_up)
        work.future.add_done_callback(handed_on)
        return encoded


def _made(work: Work) -> bool:
    """Whether ``work``'s images exist (its call ended well)."""
    f = work.future
    return f.done() and not f.cancelled() and f.exception() is None


def encode_timed(made: Sequence[RenderedImage], seconds: Histogram) -> list[EncodedImage]:
    """Each of ``made``'s files (:meth:`RenderedImage.files`: a layered image's every layer), its
    encoding's seconds observed in ``seconds``."""
    out = []
    for m in made:
        with seconds.time():
            out.extend(m.files())
    return out


def _consume(future: asyncio.Future) -> None:
    # A request that gave up leaves its future unread: reading it here keeps asyncio from
    # logging "exception was never retrieved" for a batch that failed after its client left.
    if not future.cancelled():
        future.exception()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has closed the connection (ASGI's ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
