"""The HTTP routes, on FastAPI.

==========================  ================================================================
``POST /v1/images/generations``  OpenAI's image generation: PNG, JPEG or WebP as ``b64_json``
``GET /v1/models``          the model served, its sizes, adapters and limits
``GET /health``             200 while the process lives (its phase in the body)
``GET /ready``              200 once the warm-up is done, 503 before it and while stopping
``GET /metrics``            Prometheus text format
==========================  ================================================================

Every answer other than 200 is one line of JSON in OpenAI's error shape (:mod:`.errors`),
routes not found and methods not allowed included. A 200 says what it did not honour: the
request's ignored fields in ``X-Ignored-Parameters`` (and the log), and a prompt the text encoder
cut in ``X-Prompt-Truncated`` (and the log, and ``prompt_truncated`` on each image).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .engine import Generated
from .errors import ServeError, error_body
from .metrics import CONTENT_TYPE
from .schema import ImageRequest, parse_request
from .service import Service

__all__ = ["create_app"]

logger = logging.getLogger("bcg-serve")


def _error(e: ServeError) -> Response:
    return Response(e.json(), status_code=e.status, media_type="application/json", headers=e.headers)


def _answer(request: ImageRequest, images: list[Generated]) -> Response:
    """The 200: OpenAI's images response, and headers for what was not honoured."""
    headers: dict[str, str] = {}
    data = []
    for g in images:
        item: dict[str, Any] = {"b64_json": g.b64_json, "seed": g.seed}
        if g.tokens is not None and g.tokens.truncated:
            item["prompt_truncated"] = {"tokens": g.tokens.tokens, "read": g.tokens.limit}
        data.append(item)
    tokens = images[0].tokens if images else None
    if tokens is not None and tokens.truncated:
        headers["X-Prompt-Truncated"] = f"{tokens.tokens} tokens, the first {tokens.limit} read"
        logger.warning("a prompt of %d tokens was cut at the text encoder's %d", tokens.tokens, tokens.limit)
    if request.ignored:
        headers["X-Ignored-Parameters"] = ", ".join(request.ignored)
        logger.info("accepted and ignored: %s", ", ".join(request.ignored))
    body = {"created": int(time.time()), "data": data, "output_format": request.output_format,
            "size": f"{request.width}x{request.height}"}  # fmt: skip
    return JSONResponse(body, headers=headers)


def create_app(service: Service) -> FastAPI:
    """The application serving ``service``."""
    app = FastAPI(title="bcg-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        return _error(ServeError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError) -> Response:
        return _error(e)

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        arrived = time.monotonic()
        m = service.metrics
        try:
            checked = parse_request(await request.body(), service.served)
            images = await service.generate(checked, request.receive, arrived)
        except ServeError as e:
            m.requests.labels(str(e.status)).inc()
            return _error(e)
        except Exception as e:  # a bug, not the request's fault: still one line, and logged
            logger.exception("POST /v1/images/generations failed")
            m.requests.labels("500").inc()
            return _error(ServeError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
        m.requests.labels("200").inc()
        m.request_seconds.observe(time.monotonic() - arrived)
        return _answer(checked, images)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        s = service.served
        entry: dict[str, Any] = {
            "id": s.model,
            "object": "model",
            "created": int(service.started),
            "owned_by": "bcg-diffusers",
            "sizes": s.size_names,
            "max_n": s.max_n,
            "batch_sizes": list(s.batch_sizes),
            "loras": list(s.loras),
        }
        engine = service.engine
        if engine is not None:
            d = engine.defaults
            entry.update(steps=d.steps, guidance=d.guidance)
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "phase": service.phase}

    @app.get("/ready")
    async def ready() -> Response:
        if service.phase == "ready":
            return JSONResponse({"status": "ready"})
        return JSONResponse(error_body(503, f"not ready: {service.phase}", code=service.phase), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    return app
