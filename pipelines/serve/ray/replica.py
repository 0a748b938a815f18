"""The Generator deployment: one replica, one device, one whole bcg-serve engine.

:class:`Replica` is the engine's side, Ray-free: bcg-serve's :class:`~pipelines.serve.service.Service`
(the bounded queue, the memory admission, batching and the device worker) built from the same
flags, its adapters the replica's slots (:mod:`.slots`). :func:`generator_class` wraps it for Ray
Serve: the constructor returns once the warm-up is done (Ray routes nothing to a replica before
its constructor returns: readiness is the warm-up), adapters are loaded through
``@serve.multiplexed`` (its LRU of ``--max-models-per-replica``), and ``check_health`` fails
once the device worker has stopped. With ``--parallel`` the replica is rank 0 of processes it
starts itself, one per GPU (:mod:`.followers`); its health fails once one of them is gone, and its
stop ends them.

A request's answer travels back to the frontend as a plain dict (:meth:`Replica.generate`): its
images, or its error's status, message and headers; which replica made it and how often this
replica has loaded its adapter. A streamed one's events come through Ray's streaming call
(``generate_stream``, :mod:`.streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import ServeError

__all__ = ["Replica", "generator_class"]

logger = logging.getLogger("bcg-serve")

# Seconds between pushes of the gauges into Ray's metrics.
_GAUGE_PUSH_S = 5.0


class Replica:
    """bcg-serve's engine and service for the flags ``argv`` (bcg-serve's own), started on a thread:
    :meth:`wait_ready` returns once warm, or raises the start's failure in one line."""

    def __init__(self, argv: list[str], max_models: int, name: str = "", ranks: int = 1) -> None:
        from ..batcher import Batcher
        from ..config import parse_args
        from ..schema import Served
        from ..service import Service
        from ..startup import check, starter
        from .slots import slot_specs

        self._t0 = time.monotonic()
        self.start_seconds: float | None = None  # from the constructor to warm
        config = parse_args(argv)
        self.name = name or f"pid{os.getpid()}"
        self.catalog = tuple(config.settings.loras)
        # The pipeline loads the slots; the requests name the catalog's adapters.
        slots = slot_specs(self.catalog, max_models)
        built = dataclasses.replace(config, settings=dataclasses.replace(config.settings, loras=slots))
        device, dtype = check(built)
        names = config.names or (config.settings.model,)
        served = Served(model=names[0], aliases=names[1:], sizes=config.resolutions, max_n=config.max_batch,
                        loras=tuple(s.name or "" for s in self.catalog), batch_sizes=config.batch_sizes,
                        max_steps=config.max_steps, stream=config.batching == "continuous")  # fmt: skip
        self.config = config
        self.slots: Any = None
        self.followers: Any = None
        start = starter(built, device, dtype, setup=self._setup)
        if config.settings.parallel is not None:  # this process is rank 0 of the replica's processes
            from ..ranks import agreed_start, join
            from .followers import Followers

            self.followers = Followers(argv, ranks)
            try:
                joined = join(config.settings.parallel, device)
            except BaseException:
                self.followers.stop(grace=0.0)
                raise
            start = agreed_start(starter(built, joined.device, dtype, setup=self._setup), joined)
        # --batching continuous runs here as in bcg-serve, its streams carried by Ray (.streams).
        self.service = Service(served, Batcher(config.queue, config.max_batch, config.max_wait), start,
                               config.timeout, batching=config.batching)  # fmt: skip
        self.service.start()

    def _setup(self, engine: Any) -> None:
        """On the device worker, before the warm-up: the adapter slots in the engine's place."""
        if not self.catalog:
            return
        from .slots import AdapterSlots, largest_rank

        slots = AdapterSlots(engine.pipe, self.catalog, engine.prepared.loras)
        slots.prepare(largest_rank(self.catalog))
        engine.adapters = slots
        self.slots = slots

    def wait_ready(self, poll: float = 0.05) -> None:
        while self.service.phase == "starting":
            time.sleep(poll)
        if self.service.phase != "ready":
            raise RuntimeError(f"bcg-serve replica could not start: {self.service.fatal}")
        self.start_seconds = time.monotonic() - self._t0
        logger.info("replica %s ready in %.1f s (warm-up %.1f s)", self.name, self.start_seconds,
                    self.service.engine.warmup_seconds)  # fmt: skip

    def check_health(self) -> None:
        """RuntimeError unless the replica would take a request (a full queue is healthy)."""
        gone = self.followers.gone() if self.followers is not None else None
        if gone is not None:
            raise RuntimeError(f"replica {self.name}: {gone}")
        busy = self.service.busy()
        if busy is not None and busy[0] not in ("queue_full", "busy"):
            raise RuntimeError(f"replica {self.name}: {self.service.lost or busy[1]}")

    def describe(self) -> dict[str, Any]:
        """What the frontend serves (the sizes warmed up, the adapters, the model's defaults), and
        this replica's start: its seconds from the constructor to warm, and its warm-up's."""
        engine = self.service.engine
        d = engine.defaults
        return {"served": self.service.served, "steps": d.steps, "guidance": d.guidance,
                "started": self.service.started, "replica": self.name, "start_seconds": self.start_seconds,
                "warmup_seconds": engine.warmup_seconds,
                "warmup_buckets": {b: c.seconds for b, c in engine.warmup_costs.items()}}  # fmt: skip

    def load_adapter(self, name: str) -> tuple[str, bool]:
        """Adapter ``name`` in a slot (its hot-swap made by the device worker before its first call);
        blocks (a thread) while no slot is free."""
        return self.slots.load(name, timeout=self.config.timeout)

    async def generate(self, request: Any, elapsed: float, gone: asyncio.Event) -> dict[str, Any]:
        """``request``'s images (``elapsed``: seconds since it arrived at the frontend), or its error
        as a dict. ``gone`` is set when the frontend gave up on it (its client left). Its adapter,
        if it names one, is in a slot and pinned (:meth:`pin`)."""

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        arrived = time.monotonic() - elapsed
        access: dict[str, Any] = {}
        lora = request.lora
        try:
            images = await self.service.generate(request, receive, arrived, access)
        except ServeError as e:
            return {"error": (e.status, e.message, e.param, e.code, e.headers), "replica": self.name}
        work = access.get("work")
        times = None
        if work is not None and work.taken is not None:
            times = (work.taken - work.arrived, work.device_seconds, work.encode_seconds)
        loads = self.slots.loads.get(lora, 0) if lora is not None and self.slots is not None else 0
        return {"images": images, "replica": self.name, "steps": access.get("steps"), "times": times,
                "adapter_loads": loads}  # fmt: skip

    def pin(self, lora: str | None) -> Callable[[], None]:
        """Pin ``lora``'s slot while a request for it waits or runs; returns the unpinning."""
        if lora is None or self.slots is None:
            return lambda: None
        self.slots.pin(lora)
        return lambda: self.slots.unpin(lora)

    def stop(self) -> None:
        """Stop taking requests; with --parallel, the follower ranks ended once the running call is done."""
        self.service.stop()
        if self.followers is not None:
            if self.service.engine is not None:  # its worker tells them to stop when its last call ends
                self.service.worker.join(self.config.timeout)
            self.followers.stop(grace=10.0)


class _Held:
    """What ``@serve.multiplexed`` keeps for a loaded adapter; Ray calls ``__del__`` when it evicts
    it (and the collector may again: only the first counts)."""

    def __init__(self, replica: Replica, name: str) -> None:
        self._replica, self.name, self._done = replica, name, False

    def __del__(self) -> None:
        if not self._done:
            self._done = True
            self._replica.slots.release(self.name)


def generator_class(max_models: int) -> type:
    """The Generator deployment's class, its adapter LRU ``max_models`` long (Ray's multiplexing
    takes the number when the class is made)."""
    from ray import serve

    class Generator:
        """One bcg-serve engine on this replica's device, warm before its first request."""

        async def __init__(self, argv: list[str], ranks: int = 1) -> None:
            context = serve.get_replica_context()
            self.replica = Replica(argv, max_models, name=context.replica_id.unique_id, ranks=ranks)
            await asyncio.to_thread(self.replica.wait_ready)
            from .mirror import Mirror

            self._mirror = Mirror(self.replica.service.metrics)
            self._pushing = asyncio.ensure_future(self._push_gauges())

        async def _push_gauges(self) -> None:
            while True:
                self._mirror.push()
                await asyncio.sleep(_GAUGE_PUSH_S)

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def adapter(self, name: str) -> _Held:
            await asyncio.to_thread(self.replica.load_adapter, name)
            return _Held(self.replica, name)

        async def generate(self, request: Any, elapsed: float) -> dict[str, Any]:
            if request.lora is not None:
                await self.adapter(request.lora)
            # At once, with no await between: a load for another adapter may not take the slot.
            unpin = self.replica.pin(request.lora)
            gone = asyncio.Event()
            task = asyncio.ensure_future(self.replica.generate(request, elapsed, gone))
            task.add_done_callback(lambda _: unpin())
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:  # the frontend gave up: its client left
                gone.set()
                await asyncio.wait({task})
                raise

        async def generate_stream(self, request: Any, elapsed: float) -> AsyncIterator[Any]:
            """A streamed request's head, events and tail (:func:`.streams.replica_events`), its
            adapter pinned until it ends or is cancelled (its client left)."""
            from .streams import replica_events

            if request.lora is not None:
                await self.adapter(request.lora)
            # At once, with no await between: a load for another adapter may not take the slot.
            unpin = self.replica.pin(request.lora)
            try:
                async with contextlib.aclosing(replica_events(self.replica, request, elapsed)) as events:
                    async for item in events:
                        yield item
            finally:
                unpin()

        async def describe(self) -> dict[str, Any]:
            return self.replica.describe()

        def check_health(self) -> None:
            self.replica.check_health()

        def __del__(self) -> None:
            replica = getattr(self, "replica", None)
            if replica is not None:
                replica.stop()

    return Generator
