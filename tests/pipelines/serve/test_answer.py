"""The way from a request's images to its answer, in process: the answer's bytes are the JSON
Starlette's ``JSONResponse`` wrote for the same content (the base64 is written in without
passing through the JSON encoder); the device worker's hand-over starts the encoding on the
service's encoding threads; images made in time are answered however long their encoding
takes, and images that come after their request gave up are not encoded."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.responses import JSONResponse

from pipelines.generation.prompts import TokenCount
from pipelines.serve import service as service_module
from pipelines.serve.app import _answer
from pipelines.serve.batcher import Batcher
from pipelines.serve.errors import ServeError
from pipelines.serve.rendered import EncodedImage
from pipelines.serve.schema import ImageRequest, Served
from pipelines.serve.service import Service
from tests.pipelines.serve.test_engine import FakePipeline, engine, request


def test_the_answer_is_byte_for_byte_the_json_response_of_the_same_content(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1765000000.7)
    files = [b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3, b"\xff\xd8\xff" + b"\x00\xff" * 100, b""]
    cut = TokenCount(700, 512)
    cases = [
        ([(files[0], 7, None)], ImageRequest("a", 1, 512, 512)),
        ([(files[0], 3, cut), (files[1], 4, cut)],
         ImageRequest("a", 2, 1024, 768, output_format="jpeg", ignored=("quality", "user"))),
        ([(files[2], 0, TokenCount(3, 512))], ImageRequest("a", 1, 64, 32, output_format="webp")),
    ]  # fmt: skip
    for made, req in cases:
        data = []
        for file, seed, tokens in made:
            item: dict[str, Any] = {"b64_json": base64.b64encode(file).decode("ascii"), "seed": seed}
            if tokens is not None and tokens.truncated:
                item["prompt_truncated"] = {"tokens": tokens.tokens, "read": tokens.limit}
            data.append(item)
        expected = JSONResponse({"created": 1765000000, "data": data, "output_format": req.output_format,
                                 "size": f"{req.width}x{req.height}"})  # fmt: skip
        images = [EncodedImage(base64.b64encode(file), seed, tokens) for file, seed, tokens in made]
        answer = _answer(req, images)
        assert answer.body == expected.body
        assert answer.headers["content-type"] == expected.headers["content-type"] == "application/json"
        assert answer.headers["content-length"] == expected.headers["content-length"]
        assert [g.b64_json for g in images] == [d["b64_json"] for d in data]
    second = cases[1][1], [EncodedImage(base64.b64encode(f), s, t) for f, s, t in cases[1][0]]
    assert _answer(*second).headers["x-prompt-truncated"] == "700 tokens, the first 512 read"
    assert _answer(*second).headers["x-ignored-parameters"] == "quality, user"


class Held(FakePipeline):
    """A fake pipeline whose calls wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calling = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calling.set()
        assert self.release.wait(30)
        return super().__call__(*args, **kwargs)


@pytest.fixture
def held() -> Iterator[Held]:
    pipe = Held()
    yield pipe
    pipe.release.set()


def started(pipe: FakePipeline, timeout: float) -> Service:
    e = engine(pipe)
    service = Service(Served("fake", ((16, 8),), 2), Batcher(8, 2, 0.0), lambda: e, timeout)
    service.start()
    deadline = time.monotonic() + 30
    while service.phase != "ready":
        assert time.monotonic() < deadline and service.phase != "failed", service.fatal
        time.sleep(0.01)
    return service


async def connected() -> dict[str, Any]:
    await asyncio.Event().wait()  # a client that stays: never a disconnect
    raise AssertionError


def count(service: Service, name: str) -> float:
    """The sum of sample ``name`` over its labels."""
    return sum(s.value for f in service.metrics.registry.collect() for s in f.samples if s.name == name)


def test_the_hand_over_encodes_on_the_encoding_threads_what_the_engine_alone_encodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = started(FakePipeline(), timeout=60)
    threads: list[str] = []
    encode_timed = service_module.encode_timed

    def watched(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode_timed(*args)

    monkeypatch.setattr(service_module, "encode_timed", watched)
    try:
        got = asyncio.run(service.generate(request("a", n=2, seed=5), connected, time.monotonic()))
    finally:
        service.stop()
    alone = engine(FakePipeline()).run([engine(FakePipeline()).plan(request("a", n=2, seed=5))])[0]
    assert [(g.b64, g.seed) for g in got] == [(g.b64, g.seed) for g in alone]
    assert len(threads) == 1 and threads[0].startswith("bcg-serve-encode")
    assert count(service, "bcg_serve_encode_seconds_count") == 2


def test_images_made_in_time_are_answered_however_long_their_encoding_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    service = started(FakePipeline(), timeout=1.0)
    arrived = time.monotonic()
    encode_timed = service_module.encode_timed

    def slow(*args: Any) -> Any:
        time.sleep(max(0.0, arrived + 1.2 - time.monotonic()))  # past the timeout, which the images beat
        return encode_timed(*args)

    monkeypatch.setattr(service_module, "encode_timed", slow)
    try:
        got = asyncio.run(service.generate(request("a", seed=1), connected, arrived))
    finally:
        service.stop()
    assert [g.seed for g in got] == [1]
    assert time.monotonic() - arrived > 1.0


def test_images_that_come_after_their_request_gave_up_are_not_encoded(held: Held) -> None:
    service = started(held, timeout=60)

    async def leaves_once_its_call_runs() -> dict[str, Any]:
        await asyncio.to_thread(held.calling.wait, 30)
        return {"type": "http.disconnect"}

    async def run() -> None:
        with pytest.raises(ServeError) as e:
            await service.generate(request("a", seed=1), leaves_once_its_call_runs, time.monotonic())
        assert e.value.status == 499

    try:
        asyncio.run(run())
        held.release.set()
        deadline = time.monotonic() + 30
        while count(service, "bcg_serve_images_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # an encoding set going by the hand-over would have begun by now
    finally:
        service.stop()
    assert count(service, "bcg_serve_encode_seconds_count") == 0
    dropped = {s.labels["reason"]: s.value for f in service.metrics.registry.collect() for s in f.samples
               if s.name == "bcg_serve_dropped_total" and s.value}  # fmt: skip
    assert dropped == {"disconnected_running": 1}  # its call ran: not dropped from the queue, but gone


def test_a_failed_call_is_a_500_and_nothing_is_encoded() -> None:
    pipe = FakePipeline()
    pipe.fail_on = "boom"
    service = started(pipe, timeout=60)
    try:
        with pytest.raises(ServeError) as e:
            asyncio.run(service.generate(request("boom"), connected, time.monotonic()))
    finally:
        service.stop()
    assert (e.value.status, e.value.code) == (500, "generation_failed")
    assert "the model failed on 'boom'" in e.value.message
    assert count(service, "bcg_serve_encode_seconds_count") == 0
