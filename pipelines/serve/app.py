"""The HTTP routes, on FastAPI.

==========================  ================================================================
``POST /v1/images/generations``  OpenAI's image generation: PNG, JPEG or WebP as ``b64_json``;
                            with ``stream``, its events (:mod:`.streaming`)
``POST /v1/images/edits``   OpenAI's image edits (a multipart form, :mod:`.edits`), the same answer
``GET /v1/models``          the model served, its sizes, adapters and limits
``GET /v1/models/{id}``     the same entry, by its id or an alias; 404 for another model
``GET /health``             200 while the process lives (its phase in the body); 503 once the
                            ranks of ``--parallel`` cannot serve any more
``GET /ready``              200 while a request would be taken now; 503 while warming up,
                            stopping, with the queue full, or a call running past ``--timeout``
``GET /metrics``            Prometheus text format
==========================  ================================================================

Every answer other than 200 is one line of JSON in OpenAI's error shape (:mod:`.errors`),
routes not found and methods not allowed included. A 200 says what it did not honour: the
request's ignored fields in ``X-Ignored-Parameters`` (and the log), and a prompt the text encoder
cut in ``X-Prompt-Truncated`` (and the log, and ``prompt_truncated`` on each image). Every
request leaves one line in the access log (:mod:`.access`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .access import AccessLog, fields_of
from .edits import MAX_EDIT_BYTES, parse_edit
from .errors import ServeError, error_body
from .metrics import CONTENT_TYPE
from .rendered import EncodedImage
from .schema import ImageRequest, parse_request
from .service import Service
from .streaming import MEDIA_TYPE

__all__ = ["create_app"]

logger = logging.getLogger("bcg-serve")


def _error(e: ServeError) -> Response:
    return Response(e.json(), status_code=e.status, media_type="application/json", headers=e.headers)


# Stands in for each image's base64 in the answer's JSON until the bytes take its place: no
# other value of the answer (numbers, the format's and the size's names) can contain it.
_B64 = "\ue000"
_B64_JSON = json.dumps(_B64, ensure_ascii=False).encode("utf-8")


def _json_body(body: dict[str, Any], b64: Sequence[bytes]) -> bytes:
    """``body`` as Starlette's ``JSONResponse`` writes it (compact, UTF-8), each :data:`_B64` in it
    replaced, in order, by the next of ``b64`` as a JSON string.

    The files' base64 (about a megabyte for a 512x512 PNG) never goes through the JSON encoder,
    which took milliseconds a request to scan and copy what needs no escaping (base64 is
    ``A-Za-z0-9+/=``), on the event loop's thread, where every other request waits for it; this
    takes a tenth of a millisecond (docs/benchmarks.md)."""
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")
    parts = text.split(_B64_JSON)
    if len(parts) != len(b64) + 1:
        raise AssertionError(f"{len(parts) - 1} places for {len(b64)} images in the answer")
    out = [parts[0]]
    for data, part in zip(b64, parts[1:]):
        out += (b'"', data, b'"', part)
    return b"".join(out)


def _headers(request: ImageRequest, tokens: Any) -> dict[str, str]:
    """Headers for what was not honoured: fields ignored, a prompt cut (``tokens``, where counted)."""
    headers: dict[str, str] = {}
    if tokens is not None and tokens.truncated:
        headers["X-Prompt-Truncated"] = f"{tokens.tokens} tokens, the first {tokens.limit} read"
        logger.warning("a prompt of %d tokens was cut at the text encoder's %d", tokens.tokens, tokens.limit)
    if request.ignored:
        headers["X-Ignored-Parameters"] = ", ".join(request.ignored)
        logger.info("accepted and ignored: %s", ", ".join(request.ignored))
    return headers


def _answer(request: ImageRequest, images: list[EncodedImage]) -> Response:
    """The 200: OpenAI's images response, and headers for what was not honoured."""
    data = []
    for g in images:
        item: dict[str, Any] = {"b64_json": _B64, "seed": g.seed}
        if g.layer is not None:  # a layered model's: each layer of an image is an item, in order
            item["layer"] = g.layer
        if g.tokens is not None and g.tokens.truncated:
            item["prompt_truncated"] = {"tokens": g.tokens.tokens, "read": g.tokens.limit}
        data.append(item)
    headers = _headers(request, images[0].tokens if images else None)
    body = {"created": int(time.time()), "data": data, "output_format": request.output_format,
            "size": next((g.size for g in images if g.size), f"{request.width}x{request.height}")}  # fmt: skip
    content = _json_body(body, [g.b64 for g in images])
    return Response(content, media_type="application/json", headers=headers)


async def read_form(request: Request) -> tuple[dict[str, list[str]], dict[str, list[bytes]]]:
    """A multipart form's text fields and files, each by name with every value given; ServeError
    413 for a body past :data:`~.edits.MAX_EDIT_BYTES`, 400 for one that is no multipart form."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_EDIT_BYTES:
        raise ServeError(413, f"the body is {length} bytes; at most {MAX_EDIT_BYTES}", code="body_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ServeError(400, "the body must be a multipart/form-data form, as OpenAI's images.edit sends",
                         code="invalid_body")  # fmt: skip
    try:
        form = await request.form(max_files=8, max_fields=64)
    except HTTPException as e:  # Starlette's word for a malformed form
        raise ServeError(400, f"the form cannot be read: {e.detail}", code="invalid_body") from None
    fields: dict[str, list[str]] = {}
    files: dict[str, list[bytes]] = {}
    try:
        for name, value in form.multi_items():
            if isinstance(value, str):
                fields.setdefault(name, []).append(value)
            else:
                files.setdefault(name, []).append(await value.read())
    finally:
        await form.close()
    return fields, files


def create_app(service: Service) -> FastAPI:
    """The application serving ``service``."""
    app = FastAPI(title="bcg-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLog)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        return _error(ServeError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError) -> Response:
        return _error(e)

    async def answer(request: Request, parse: Callable[[Request], Awaitable[ImageRequest]]) -> Response:
        """A request read by ``parse``, queued, and answered with its images or its error in one line."""
        arrived = time.monotonic()
        m = service.metrics
        access = fields_of(request.scope)
        try:
            checked = await parse(request)
            access.update(model=service.served.model, size=f"{checked.width}x{checked.height}", n=checked.n)
            if checked.stream:  # queued now (so its errors are JSON answers), then answered as events
                stream = await service.stream(checked, request.receive, arrived, access)
                m.requests.labels("200").inc()
                return StreamingResponse(stream.events(), media_type=MEDIA_TYPE, headers=_headers(checked, None))
            images = await service.generate(checked, request.receive, arrived, access)
        except ServeError as e:
            m.requests.labels(str(e.status)).inc()
            return _error(e)
        except Exception as e:  # a bug, not the request's fault: still one line, and logged
            logger.exception("%s %s failed", request.method, request.url.path)
            m.requests.labels("500").inc()
            return _error(ServeError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
        m.requests.labels("200").inc()
        m.request_seconds.observe(time.monotonic() - arrived)
        return _answer(checked, images)

    async def generation(request: Request) -> ImageRequest:
        return parse_request(await request.body(), service.served)

    async def edit(request: Request) -> ImageRequest:
        fields, files = await read_form(request)
        return parse_edit(fields, files, service.served)

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        return await answer(request, generation)

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> Response:
        return await answer(request, edit)

    def model_entry() -> dict[str, Any]:
        s = service.served
        entry: dict[str, Any] = {
            "id": s.model,
            "object": "model",
            "created": int(service.started),
            "owned_by": "bcg-diffusers",
            "aliases": list(s.aliases),
            "sizes": s.size_names,
            "max_n": s.max_n,
            "max_steps": s.max_steps,
            "batch_sizes": list(s.batch_sizes),
            "loras": list(s.loras),
        }
        engine = service.engine
        if engine is not None:
            d = engine.defaults
            entry.update(steps=d.steps, guidance=d.guidance)
        return entry

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if not service.served.serves(model):
            raise ServeError(404, f"the model {model!r} does not exist here; this server serves "
                             f"{service.served.model!r}", param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(model_entry())

    @app.get("/health")
    async def health() -> Response:
        if service.lost is not None:  # alive, but it will never serve again: restart it
            return JSONResponse(error_body(503, f"unhealthy: {service.lost}", code="ranks_lost"), status_code=503)
        return JSONResponse({"status": "ok", "phase": service.phase})

    @app.get("/ready")
    async def ready() -> Response:
        busy = service.busy()
        if busy is None:
            return JSONResponse({"status": "ready"})
        code, why = busy
        return JSONResponse(error_body(503, f"not ready: {why}", code=code), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    return app
