"""A generation request answered as OpenAI's image streaming events (``stream: true``).

The answer is server-sent events (``text/event-stream``): ``image_generation.partial_image`` for
each preview (``partial_images``, 0 to 3; ``partial_image_index`` from 0), then one
``image_generation.completed`` with the image itself, the very file the request's JSON answer
would carry. Previews are made by the device worker of ``--batching continuous`` from the model's
estimate of the clean image at evenly spaced steps (:mod:`.continuous`); a request whose steps are
too few for them gets fewer, as OpenAI allows. A failure after the events began is an ``error``
event in OpenAI's error shape (its client raises ``APIError``); a request past ``--timeout`` ends
with one (504), and a client that leaves gives its request up as a JSON request's does.

The request is queued before the first byte is sent, so a 400, 429 or 503 is an ordinary JSON
answer. Partial images are encoded on the service's encoding threads like the final image, and
sent in the order they were made.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from .batcher import Closed
from .errors import ServeError, error_body, one_line
from .rendered import EncodedImage, RenderedImage
from .schema import ImageRequest
from .worker import BatchFailed, RequestGone

__all__ = ["COMPLETED", "PARTIAL", "ImageStream", "event_bytes"]

logger = logging.getLogger("bcg-serve")

PARTIAL = "image_generation.partial_image"
COMPLETED = "image_generation.completed"
MEDIA_TYPE = "text/event-stream"


def event_bytes(event: str, body: dict[str, Any], b64: bytes | None = None) -> bytes:
    """One server-sent event: ``event`` and ``body`` as its one line of JSON data, with ``b64``
    (an image's base64, ASCII) as its first field ``b64_json``, never through the JSON encoder."""
    data = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    if b64 is not None:
        data = b'{"b64_json":"' + b64 + b'"' + (b"," + data[1:] if len(data) > 2 else b"}")
    return b"event: " + event.encode("ascii") + b"\ndata: " + data + b"\n\n"


class ImageStream:
    """One streamed request: queued when made (ServeError 400, 429 or 503 where it cannot be),
    then :meth:`events`, the bytes of its events. RenderedImage on the event loop's thread."""

    def __init__(self, service: Any, request: ImageRequest, arrived: float,
                 access: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.service = service
        self.request = request
        self.arrived = arrived
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, concurrent.futures.Future]] = asyncio.Queue()
        self.work = service.submit(request, arrived, access, partial=self._partial)
        self._final = service.encode_when_made(self.work)
        self._final.add_done_callback(lambda f: self._put("completed", f))
        self._ended = False

    def _put(self, kind: str, future: concurrent.futures.Future) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, future))

    def _partial(self, step: int, image: Any) -> None:  # the device worker's thread
        r = self.request
        seed = self.work.plan.seeds[0]
        self._put("partial", self.service.encode_later(RenderedImage(image, {}, seed, None, r.output_format,
                                                                 r.output_compression)))  # fmt: skip

    def _common(self) -> dict[str, Any]:
        r = self.request
        return {"created_at": int(time.time()), "size": f"{r.width}x{r.height}", "quality": "auto",
                "background": "opaque", "output_format": r.output_format}  # fmt: skip

    async def events(self) -> AsyncIterator[bytes]:
        """The events' bytes, partial images first; an ``error`` event where it fails or times out."""
        index = 0
        try:
            while True:
                left = self.service.timeout - (time.monotonic() - self.arrived)
                kind, future = await asyncio.wait_for(self._events.get(), timeout=max(left, 0.0))
                if kind == "partial":
                    try:
                        g: EncodedImage = await asyncio.wrap_future(future)
                    except Exception as e:  # a preview is a courtesy: the image still comes
                        logger.warning("a partial image could not be encoded: %s", one_line(e))
                        continue
                    yield event_bytes(PARTIAL, {"type": PARTIAL, **self._common(), "partial_image_index": index},
                                      g.b64)  # fmt: skip
                    index += 1
                    continue
                yield await self._completed(future)
                return
        except TimeoutError:
            self.service.give_up(self.work, "timeout")
            self._final.cancel()
            self._ended = True
            error = ServeError(504, f"not done within --timeout {self.service.timeout:g} s; the request was dropped",
                               code="timeout")  # fmt: skip
            yield event_bytes("error", error.body())
        finally:
            if not self._ended and not self._final.done():  # the client left mid-stream
                self.service.give_up(self.work, "disconnected")
                self._final.cancel()

    async def _completed(self, future: concurrent.futures.Future) -> bytes:
        self._ended = True
        try:
            (g,) = await asyncio.wrap_future(future)
        except BatchFailed as e:
            return event_bytes("error", error_body(500, str(e), code="generation_failed"))
        except (Closed, RequestGone):
            return event_bytes("error", error_body(503, "the server is stopping", code="shutting_down"))
        tokens = g.tokens.tokens if g.tokens is not None else 0
        usage = {"input_tokens": tokens, "input_tokens_details": {"image_tokens": 0, "text_tokens": tokens},
                 "output_tokens": 0, "total_tokens": tokens}  # fmt: skip
        self.service.metrics.request_seconds.observe(time.monotonic() - self.arrived)
        return event_bytes(COMPLETED, {"type": COMPLETED, **self._common(), "usage": usage, "seed": g.seed}, g.b64)
