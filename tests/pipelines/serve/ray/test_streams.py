"""The frontend's side of a streamed request (:class:`pipelines.serve.ray.streams.RemoteStream`)
against stand-ins for Ray's streaming responses, no cluster: the replica's events sent on as they
come and its tail read into the access log; a replica lost before the first event has the request
sent again, one lost after ends the stream with an ``error`` event; a replica that does not answer
in time, a 504 event; a stream left unfinished (its client gone) cancels its call."""

from __future__ import annotations

import asyncio
import json
import time
import types
from typing import Any

import pytest

pytest.importorskip("ray", reason="the [ray] extra")

from ray.exceptions import ActorUnavailableError

from pipelines.serve.errors import ServeError
from pipelines.serve.metrics import Metrics
from pipelines.serve.ray import streams
from pipelines.serve.ray.streams import RemoteStream

LOST = ActorUnavailableError("the replica died", None)


class Response:
    """A streaming response's stand-in: its items (an exception is raised where it stands; a float
    is a wait of that many seconds), and whether it was cancelled."""

    def __init__(self, *items: Any) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, float):
            await asyncio.sleep(item)
            return await self.__anext__()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def service(timeout: float = 30.0) -> Any:
    return types.SimpleNamespace(config=types.SimpleNamespace(timeout=timeout), metrics=Metrics(2, lambda: 0))


async def run(stream: RemoteStream, take: int | None = None) -> list[bytes]:
    out = []
    events = stream.events()
    async for chunk in events:
        out.append(chunk)
        if take is not None and len(out) == take:
            await events.aclose()  # as Starlette does when its client leaves
            break
    return out


def error_of(event: bytes) -> dict[str, Any]:
    name, data = event.decode().strip().split("\n")
    assert name == "event: error"
    return json.loads(data.removeprefix("data: "))["error"]


def test_events_are_sent_on_and_the_tail_is_logged() -> None:
    access: dict[str, Any] = {}
    response = Response(b"event: a\n\n", b"event: b\n\n", {"times": (0.5, 2.0, 0.1), "bucket": 2})
    stream = RemoteStream(service(), response, _no_resend, 0.0, access)
    assert asyncio.run(run(stream)) == [b"event: a\n\n", b"event: b\n\n"]
    work = access["work"]
    assert (work.taken - work.arrived, work.device_seconds, work.bucket) == (0.5, 2.0, 2)
    assert not response.cancelled


def test_a_replica_lost_before_the_first_event_is_sent_again_and_after_it_is_an_error_event() -> None:
    again = Response(b"event: completed\n\n")
    sent: list[Response] = []

    async def resend() -> Response:
        sent.append(again)
        return again

    first = RemoteStream(service(), Response(LOST), resend, 0.0, None)
    assert asyncio.run(run(first)) == [b"event: completed\n\n"] and sent == [again]

    late = RemoteStream(service(), Response(b"event: partial\n\n", LOST), resend, 0.0, None)
    out = asyncio.run(run(late))
    assert out[0] == b"event: partial\n\n" and len(out) == 2 and len(sent) == 1
    assert error_of(out[1])["code"] == "replica_lost"

    async def refused() -> Response:
        raise ServeError(429, "every replica's queue is full", code="queue_full")

    full = RemoteStream(service(), Response(LOST), refused, 0.0, None)
    (event,) = asyncio.run(run(full))
    assert error_of(event)["code"] == "queue_full"


def test_a_replica_that_does_not_answer_in_time_is_a_504_event_and_a_client_that_leaves_cancels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streams, "GRACE_S", 0.2)
    slow = Response(60.0)
    stream = RemoteStream(service(timeout=0.3), slow, _no_resend, time.monotonic(), None)
    (event,) = asyncio.run(run(stream))
    assert error_of(event)["code"] == "timeout" and slow.cancelled

    left = Response(b"event: partial\n\n", b"event: partial\n\n", b"event: completed\n\n")
    assert asyncio.run(run(RemoteStream(service(), left, _no_resend, 0.0, None), take=1)) == [b"event: partial\n\n"]
    assert left.cancelled


async def _no_resend() -> Any:
    raise AssertionError("sent again")
