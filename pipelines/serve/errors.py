"""The one error every route answers with: an HTTP status and OpenAI's error shape, on one line.

    {"error": {"message": "size '100x100' is not served (served: 512x512)", "type":
     "invalid_request_error", "param": "size", "code": "unknown_size"}}

OpenAI's clients read ``error.message``; ``type`` says whose fault it is (the request's, the
server's load, or the server), ``param`` names the field, ``code`` is stable for programs.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ServeError", "error_body", "one_line"]

# The OpenAI error type for each status this server answers with.
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_unavailable",
    504: "timeout",
}


def one_line(text: object) -> str:
    """``text`` on one line: an exception's message may span several, a response must not."""
    return " ".join(str(text).split())


class ServeError(Exception):
    """An answer other than 200: ``status``, a one-line ``message``, the field at fault
    (``param``), a stable ``code`` and extra response ``headers`` (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(one_line(message))
        self.status = status
        self.message = one_line(message)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def json(self) -> bytes:
        """The response body: compact JSON, one line (a newline in a message is escaped)."""
        return json.dumps(self.body(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": one_line(message),
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
