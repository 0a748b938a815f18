"""The Frontend deployment: bcg-serve's routes (:func:`pipelines.serve.app.create_app`) as Ray
Serve's FastAPI ingress, each generation request handed to a Generator replica.

The routes are bcg-serve's: a request is read and checked here (its 400 costs no replica), then
:class:`RemoteService` sends it through the Generator's deployment handle, its adapter named as
Ray's multiplexed model id (so it goes to a replica that holds that adapter where one is free),
and waits for its images, its client leaving (the replica is told and drops it) or the replica's
own answer (429, 504 ...). What is not the request's fault is dealt with here:

* every replica full and the handle's queue too (Ray's ``BackPressureError``): 429, with
  Retry-After, saying so;
* the replica died under it (killed, its node lost): sent again, to another replica, up to
  ``--retries`` times, within the request's ``--timeout``; a request is never lost silently;
* no replica yet (all still warming up): it waits in the handle's queue, as Ray does.

A request with ``stream`` (``--batching continuous``) goes through Ray Serve's streaming handle:
its replica makes bcg-serve's events and the frontend sends them on as they come (:mod:`.streams`).

``/ready`` is 200 once a replica has answered (the frontend learns the sizes warmed up and the
model's defaults from it); ``/metrics`` is the frontend's own registry (requests by status,
seconds to answer). The replicas' metrics are Ray's (:mod:`.mirror`). Each answer names the
replica that made it (``X-Bcg-Replica``), for an adapter how often that replica has loaded it
(``X-Bcg-Adapter-Loads``), and for a request sent again how many times it was sent
(``X-Bcg-Tries``), as the access log does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import types
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..access import fields_of
from ..errors import ServeError
from .streams import RemoteStream, work_of

__all__ = ["RemoteService", "ReplicaHeaders", "frontend_class"]

logger = logging.getLogger("bcg-serve")

Receive = Callable[[], Awaitable[dict[str, Any]]]


class RemoteService:
    """What :func:`~pipelines.serve.app.create_app` asks of a service (``phase``, ``served``,
    ``metrics``, ``engine``, ``started``, ``busy``, ``generate``, ``stream``), answered by Generator
    replicas through ``handle``."""

    def __init__(self, handle: Any, config: Any, retries: int) -> None:
        from ..metrics import Metrics
        from ..schema import Served

        self.handle = handle
        self.config = config
        self.retries = retries
        names = config.names or (config.settings.model,)
        self.served = Served(model=names[0], aliases=names[1:], sizes=config.resolutions, max_n=config.max_batch,
                             loras=tuple(s.name or "" for s in config.settings.loras),
                             batch_sizes=config.batch_sizes, max_steps=config.max_steps,
                             stream=config.batching == "continuous")  # fmt: skip
        self.metrics = Metrics(config.max_batch, lambda: 0, config.batch_sizes)
        self.phase = "starting"
        self.engine: Any = None
        self.started = time.time()
        self.replicas: set[str] = set()

    async def learn(self) -> None:
        """Wait for a replica (each one answers only once warm) and take what it serves."""
        while True:
            try:
                d = await self.handle.describe.remote()
                break
            except Exception as e:  # a replica that failed its start: Ray starts another
                logger.warning("waiting for a replica: %s", str(e).splitlines()[0][:200])
                await asyncio.sleep(1)
        self.served = d["served"]
        self.engine = types.SimpleNamespace(defaults=types.SimpleNamespace(steps=d["steps"], guidance=d["guidance"]))
        self.phase = "ready"
        self.metrics.ready.set(1)
        logger.info("ready: a replica serves %s at %s", self.served.model, ", ".join(self.served.size_names))

    def busy(self) -> tuple[str, str] | None:
        if self.phase != "ready":
            return self.phase, "no replica has finished its warm-up yet" if self.phase == "starting" else self.phase
        return None

    def _full(self, error: Any) -> ServeError:
        """The 429 of Ray's ``BackPressureError`` (its args: queued, most queued, status, Retry-After)."""
        args = tuple(getattr(error, "args", ())) + (None,) * 4
        most, retry_after = args[1], args[3]
        mean = self.metrics.mean_batch_seconds
        wait = retry_after if retry_after is not None else (1.0 if math.isnan(mean) else mean)
        return ServeError(429, f"every replica's queue is full ({self.config.queue} requests waiting at each, and "
                          f"{most if most is not None else 'the most'} more waiting for a replica); retry later",
                          code="queue_full", headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip

    async def generate(self, request: Any, receive: Receive, arrived: float,
                       access: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        """``request``'s images from a replica, or :class:`ServeError`, as
        :meth:`pipelines.serve.service.Service.generate` answers."""
        handle = self._handle(request, stream=False)
        _, result = await self._send(lambda elapsed: handle.generate.remote(request, elapsed), _result, receive,
                                     arrived, access)  # fmt: skip
        return self._answered(result, access)

    async def stream(self, request: Any, receive: Receive, arrived: float,
                     access: dict[str, Any] | None = None) -> RemoteStream:  # fmt: skip
        """``request`` queued at a replica, to be answered as its events (:class:`.streams.RemoteStream`),
        or :class:`ServeError` where it cannot be, as :meth:`pipelines.serve.service.Service.stream`."""
        handle = self._handle(request, stream=True)

        async def send(receive: Receive = _never) -> Any:
            response, head = await self._send(lambda elapsed: handle.generate_stream.remote(request, elapsed),
                                              _head, receive, arrived, access)  # fmt: skip
            self._took(head, access)
            return response

        return RemoteStream(self, await send(receive), send, arrived, access)

    def _handle(self, request: Any, stream: bool) -> Any:
        """The Generator's handle for ``request``: its adapter, if it names one, as Ray's multiplexed
        model id (to a replica that holds it)."""
        options: dict[str, Any] = {"stream": True} if stream else {}
        if request.lora is not None:
            options["multiplexed_model_id"] = request.lora
        return self.handle.options(**options) if options else self.handle

    async def _send(self, call: Callable[[float], Any], first: Callable[[Any], Awaitable[Any]], receive: Receive,
                    arrived: float, access: dict[str, Any] | None) -> tuple[Any, Any]:  # fmt: skip
        """``call(elapsed)``'s response and ``first(response)`` (its result, or a stream's head), sent
        again to another replica where one dies under it, within ``--timeout``; ServeError for a
        client that left (499), every replica full (429) or no answer in time (504)."""
        from ray.exceptions import ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

        lost = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)

        if self.phase != "ready":
            raise ServeError(503, "the server is warming up (GET /ready says when it is done)", code="warming_up",
                             headers={"Retry-After": "5"})  # fmt: skip
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            for attempt in range(self.retries + 1):
                left = self.config.timeout - (time.monotonic() - arrived)
                if left <= 0:
                    break
                response = call(time.monotonic() - arrived)
                answer = asyncio.ensure_future(first(response))
                # The replica answers its own timeout (504); this one is for a replica that cannot.
                try:
                    done, _ = await asyncio.wait({answer, gone}, timeout=left + 5,
                                                 return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                except asyncio.CancelledError:  # the route itself was cancelled (its client left)
                    response.cancel()
                    answer.cancel()
                    raise
                if answer not in done:
                    response.cancel()
                    answer.cancel()
                    if gone in done:
                        raise ServeError(499, "the client closed the connection", code="client_closed")
                    break
                try:
                    result = answer.result()
                except BackPressureError as e:
                    raise self._full(e) from None
                except lost as e:
                    logger.warning("a replica died under a request (try %d of %d): %s", attempt + 1,
                                   self.retries + 1, str(e).splitlines()[0][:200])  # fmt: skip
                    continue
                if access is not None and attempt:
                    access["tries"] = attempt + 1
                return response, result
        finally:
            gone.cancel()
        raise ServeError(504, f"not done within --timeout {self.config.timeout:g} s (its replica was lost "
                         f"{self.retries + 1} time(s) or did not answer)", code="timeout")  # fmt: skip

    def _took(self, result: dict[str, Any], access: dict[str, Any] | None) -> None:
        """The replica that took a request, in ``access``; its error raised as :class:`ServeError`."""
        replica = result["replica"]
        self.replicas.add(replica)
        if access is not None:
            access["replica"] = replica
            access["adapter_loads"] = result.get("adapter_loads")
            if result.get("steps") is not None:
                access["steps"] = result["steps"]
        if "error" in result:
            status, message, param, code, headers = result["error"]
            raise ServeError(status, message, param=param, code=code, headers=headers)

    def _answered(self, result: dict[str, Any], access: dict[str, Any] | None) -> list[Any]:
        self._took(result, access)
        if access is not None:
            times = result.get("times")
            if times is not None:
                access["work"] = work_of(times)
        return result["images"]


async def _result(response: Any) -> Any:
    return await response


async def _head(response: Any) -> Any:
    return await response.__anext__()


async def _never() -> dict[str, Any]:
    """An ASGI receive whose client never leaves: for a stream sent again once its answer began,
    whose client leaving ends the answer's own iteration."""
    return await asyncio.get_running_loop().create_future()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ReplicaHeaders:
    """ASGI middleware: the replica that made an answer (``X-Bcg-Replica``), for an adapter how
    often that replica has loaded it (``X-Bcg-Adapter-Loads``), and the times a request was sent
    (``X-Bcg-Tries``, where more than once), read from the access-log fields the route set (the
    access log's middleware is inside this one)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                fields = fields_of(scope)
                extra = []
                if fields.get("replica"):
                    extra.append((b"x-bcg-replica", str(fields["replica"]).encode()))
                if fields.get("adapter_loads"):
                    extra.append((b"x-bcg-adapter-loads", str(fields["adapter_loads"]).encode()))
                if fields.get("tries"):
                    extra.append((b"x-bcg-tries", str(fields["tries"]).encode()))
                # Ray's proxy gives the request its X-Request-Id (the client's, else a fresh one) and
                # writes it on the answer itself: the access log's copy would be a second one.
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message["headers"] = [*kept, *extra]
            await send(message)

        await self.app(scope, receive, send_named)


def frontend_class() -> type:
    """The Frontend deployment's class (Ray Serve's FastAPI ingress, its app made per replica)."""
    from ray import serve

    @serve.ingress()
    class Frontend:
        """bcg-serve's routes, answered by the Generator replicas behind ``generator``."""

        async def __init__(self, generator: Any, argv: list[str], retries: int) -> None:
            from ..config import parse_args

            self.service = RemoteService(generator, parse_args(argv), retries)
            self._learning = asyncio.ensure_future(self.service.learn())

        def __serve_build_asgi_app__(self) -> Any:
            from ..app import create_app

            app = create_app(self.service)
            app.add_middleware(ReplicaHeaders)
            return app

    return Frontend
