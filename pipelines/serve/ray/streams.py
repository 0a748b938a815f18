"""A streamed request (``stream: true``) across Ray: bcg-serve's events, made on a replica.

The replica makes the events exactly as bcg-serve does (:class:`~pipelines.serve.streaming.ImageStream`
on its own service), and a Ray Serve streaming call (``handle.options(stream=True)``) carries them
to the frontend, which sends them on as they come. What the call yields (:func:`replica_events`):

* first a head, a dict: which replica took the request and how often it has loaded its adapter,
  and, where the request could not be queued there (429, 503 ...), its error. The frontend waits
  for it before it answers, so such an error is an ordinary JSON answer, as with bcg-serve, and a
  replica lost before it is one the request is sent again from;
* then each event's bytes (partial images, then the image or an ``error`` event), sent on as they are;
* last a tail, a dict: where the request's time went, for the access log.

A client that leaves mid-stream ends the frontend's iteration, which cancels the call; Ray raises
``CancelledError`` in the replica's generator, whose stream gives its request up as bcg-serve's
does (out of the queue, or nothing more made for it), and its adapter is unpinned. A replica lost
before any event was sent has the request sent again (``--retries``, within ``--timeout``); once
events went out, the stream ends with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..errors import ServeError, one_line
from ..streaming import ImageStream, event_bytes

__all__ = ["RemoteStream", "replica_events", "work_of"]

logger = logging.getLogger("bcg-serve")

Head = dict[str, Any]

# Seconds past --timeout the frontend waits for a replica's next item: the replica answers its own
# timeout (a 504 event); this is for a replica that cannot.
GRACE_S = 5.0


def _error_of(e: ServeError) -> tuple[Any, ...]:
    return (e.status, e.message, e.param, e.code, e.headers)


async def replica_events(replica: Any, request: Any, elapsed: float) -> AsyncIterator[Head | bytes]:
    """The replica's side: ``request`` (``elapsed``: seconds since it arrived at the frontend)
    queued on ``replica``'s service, then its head, its events' bytes and its tail."""
    arrived = time.monotonic() - elapsed
    access: dict[str, Any] = {}
    try:
        stream = ImageStream(replica.service, request, arrived, access)
    except ServeError as e:
        yield {"error": _error_of(e), "replica": replica.name}
        return
    lora, slots = request.lora, replica.slots
    # Read now, the swap maybe still due: the answer's headers go before its image is made.
    loads = slots.loads_of(lora) if lora is not None and slots is not None else 0
    yield {"replica": replica.name, "steps": access.get("steps"), "adapter_loads": loads}
    # Closed explicitly: cancelled at a yield, the stream's own clean-up (giving the request up)
    # must run now, not when the collector finds it.
    async with contextlib.aclosing(stream.events()) as events:
        async for chunk in events:
            yield chunk
    work = stream.work
    if work.taken is not None:
        yield {"times": (work.taken - work.arrived, work.device_seconds, work.encode_seconds), "bucket": work.bucket}


class RemoteStream:
    """The frontend's side of one streamed request: :meth:`events` sends on the events of ``response``
    (a Ray ``DeploymentResponseGenerator`` whose head was read), sending the request again through
    ``resend`` where its replica is lost before the first event."""

    def __init__(self, service: Any, response: Any, resend: Callable[[], Awaitable[Any]], arrived: float,
                 access: dict[str, Any] | None) -> None:  # fmt: skip
        self.service = service
        self.response = response
        self.resend = resend
        self.arrived = arrived
        self.access = access
        self._finished = False

    async def _next(self) -> Any:
        """The call's next item; StopAsyncIteration at its end, TimeoutError past ``--timeout`` and
        :data:`GRACE_S`."""
        left = self.service.config.timeout - (time.monotonic() - self.arrived)
        return await asyncio.wait_for(self.response.__anext__(), timeout=max(left, 0.0) + GRACE_S)

    async def events(self) -> AsyncIterator[bytes]:
        """The events' bytes as the replica made them; an ``error`` event where the replica is lost
        after the first or does not answer in time."""
        from ray.exceptions import ActorUnavailableError, RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError

        lost = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
        sent = 0
        timeout = self.service.config.timeout
        try:
            while True:
                try:
                    item = await self._next()
                except StopAsyncIteration:
                    self._finished = True
                    return
                except TimeoutError:
                    error = ServeError(504, f"not done within --timeout {timeout:g} s (its replica did not answer)",
                                       code="timeout")  # fmt: skip
                    yield event_bytes("error", error.body())
                    return
                except lost as e:
                    logger.warning("a replica died under a streamed request (%d events sent): %s", sent,
                                   one_line(e)[:200])  # fmt: skip
                    self._finished = True
                    if sent:
                        error = ServeError(502, "the replica making this image was lost after its first events; "
                                           "send the request again", code="replica_lost")  # fmt: skip
                        yield event_bytes("error", error.body())
                        return
                    try:  # nothing sent yet: as an unstreamed request, it is sent again
                        self.response = await self.resend()
                    except ServeError as e:
                        yield event_bytes("error", e.body())
                        return
                    self._finished = False
                    continue
                if isinstance(item, bytes):
                    sent += 1
                    yield item
                elif "times" in item:  # the tail
                    self.service.metrics.request_seconds.observe(time.monotonic() - self.arrived)
                    if self.access is not None:
                        self.access["work"] = work_of(item["times"], item.get("bucket"))
        finally:
            if not self._finished:  # the client left (or the replica is late): the replica gives it up
                self.response.cancel()


def work_of(times: tuple[float, float, float], bucket: int | None = None) -> Any:
    """What the access line reads of a request's work (:class:`~pipelines.serve.batcher.Work`), as its
    replica measured it: seconds queued, on the device and encoding."""
    queued, device, encode = times
    return types.SimpleNamespace(arrived=1.0, taken=1.0 + queued, device_seconds=device, encode_seconds=encode,
                                 bucket=bucket)  # fmt: skip
