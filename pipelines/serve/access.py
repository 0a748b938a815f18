"""The access log: one line per HTTP request, whatever its answer, and the request's id.

    access: id=5f0c2a9e1b7d4c3a POST /v1/images/generations 200 412.3 ms model=z-image size=64x64
      n=1 steps=1 queue_ms=0.2 device_ms=380.1 encode_ms=3.0

Every request gets an id: the client's ``X-Request-Id`` where it sends a short one of letters,
digits, ``.``, ``_`` and ``-``, else a fresh one; the answer carries it back in ``X-Request-Id``,
so a client's complaint can be found in the log. A route adds its own fields
(:func:`fields_of`): a generation request the model, size, images, steps and where its time went
(in the queue, in the pipeline calls that made its images, encoding its files). The middleware is
plain ASGI: it reads nothing of the request's body and leaves ``receive`` alone, so a route still
sees its client leave.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["AccessLog", "access_line", "fields_of"]

logger = logging.getLogger("bcg-serve.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_SCOPE_KEY = "bcg_serve.access"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def fields_of(scope: Scope) -> dict[str, Any]:
    """The access-log fields of the request of ``scope``, which its route may add to (an empty
    dict where the middleware is not installed)."""
    return scope.get(_SCOPE_KEY) or {}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def access_line(method: str, path: str, status: int, seconds: float, fields: dict[str, Any]) -> str:
    """One request's line: its id, method, path, status and milliseconds, then the route's fields
    (a generation request's ``work``, :class:`~.batcher.Work`, gives its queue, device and encode
    times; the rest are written as ``key=value``)."""
    parts = [f"id={fields.get('id', '-')}", method, path, str(status), f"{seconds * 1000:.1f} ms"]
    for key, value in fields.items():
        if key not in ("id", "work") and value is not None:
            parts.append(f"{key}={value}")
    work = fields.get("work")
    if work is not None:
        queued = (work.taken - work.arrived) if work.taken is not None else None
        if work.bucket is not None:
            parts.append(f"bucket={work.bucket}")
        parts += [f"queue_ms={_ms(queued)}", f"device_ms={_ms(work.device_seconds if work.taken else None)}",
                  f"encode_ms={_ms(work.encode_seconds if work.encode_seconds else None)}"]  # fmt: skip
    return " ".join(parts)


class AccessLog:
    """ASGI middleware: an id for every HTTP request, and its line in the log once answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:  # fmt: skip
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        fields: dict[str, Any] = {"id": given if _CLIENT_ID.match(given) else secrets.token_hex(8)}
        scope[_SCOPE_KEY] = fields
        status = 500  # what the client gets if the app fails before it answers
        t0 = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", fields["id"].encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            logger.info("%s", access_line(scope.get("method", "-"), scope.get("path", "-"), status,
                                          time.monotonic() - t0, fields))  # fmt: skip
