"""Start and stop: flags, the listening socket, the device worker, uvicorn, signals, exit status.

The socket is bound before the model is built, so a port in use is said at once and ``/health``
answers during the warm-up. SIGTERM (and Ctrl-C) stop the server gracefully: the service stops
accepting and answers what waits with 503, uvicorn closes the listening socket and waits for
the running batch's answers, and the process exits 0 (130 after Ctrl-C). A model that fails to
load or warm up ends the server with one line and status 1. Under ``--parallel`` rank 0 does all
this, and the other ranks follow its calls (:mod:`.ranks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .config import PROG, ServeConfig, UsageError, parse_args
from .ranks import agreed_start, follow, join, launch_rank

__all__ = ["main", "serve"]

logger = logging.getLogger("bcg-serve")

BAD_INPUT = 2
INTERRUPTED = 130


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or UsageError in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def _sigterm_ignored_after() -> Iterator[None]:
    """uvicorn raises the signal it stopped on again once it is done (so the default action
    runs): for SIGTERM that would end a clean stop with status 143. A no-op handler underneath
    takes that second SIGTERM; Ctrl-C's becomes KeyboardInterrupt as usual."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, told about the service: a failed start ends it, and a stop first
        closes the service's queue (before uvicorn waits for the connections to finish)."""

        service: Any = None

        async def on_tick(self, counter: int) -> bool:
            if self.service.phase == "failed":
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            serving = self.service.phase == "ready"
            self.service.stop()
            await super().shutdown(sockets)
            if serving:  # a model still loading is not waited for (the worker is a daemon thread)
                # The running batch ended with its requests' answers, unless all of them gave
                # up: give it the time a request has.
                await asyncio.to_thread(self.service.worker.join, self.service.timeout)

    return Server


def serve(config: ServeConfig, start: Callable[[], Any], sock: socket.socket | None = None) -> int:
    """Run the server until stopped; ``start`` builds the engine on the device worker's thread.
    Returns the exit status. The caller has set up logging."""
    import prometheus_client
    import uvicorn

    from .app import create_app
    from .batcher import Batcher
    from .schema import Served
    from .service import Service

    prometheus_client.disable_created_metrics()  # a *_created series per counter is noise here
    sock = sock if sock is not None else _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    names = config.names or (config.settings.model,)
    served = Served(model=names[0], aliases=names[1:], sizes=config.resolutions, max_n=config.max_batch,
                    loras=tuple(spec.name or "" for spec in config.settings.loras), batch_sizes=config.batch_sizes,
                    max_steps=config.max_steps, stream=config.batching == "continuous")  # fmt: skip
    service = Service(served, Batcher(config.queue, config.max_batch, config.max_wait), start, config.timeout,
                      batching=config.batching)  # fmt: skip
    uv = uvicorn.Config(create_app(service), log_config=None, access_log=False, lifespan="off",
                        timeout_graceful_shutdown=int(config.timeout) + 1)  # fmt: skip
    server = _server_class()(uv)
    server.service = service
    logger.info("listening on http://%s:%d (warming up; GET /ready answers 200 when done)", host, port)
    service.start()
    interrupted = False
    with _sigterm_ignored_after():
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # the Ctrl-C uvicorn raises again after stopping cleanly
            interrupted = True
    if service.fatal is not None:
        return service.fatal_status
    if service.lost is not None:  # --parallel: a rank was lost while serving
        logger.error("stopped; it could not serve since: %s", service.lost)
        return 1
    logger.info("stopped")
    return INTERRUPTED if interrupted else 0


def _setup_logging(quiet: bool, tag: str = "") -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    logging.getLogger().setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-serve``; returns the exit status (0 stopped, 1 failed to start, 2 bad input,
    130 interrupted)."""
    from pipelines.generation.errors import GenerationError
    from pipelines.generation.extras import require

    try:
        config = parse_args(argv)
        # Before anything is bound or built: without the extra, serve() would fail on its first
        # import after the model had been built for seconds.
        require("serve", PROG)
        parallel = config.settings.parallel
        rank, world = launch_rank(parallel) if parallel is not None else (0, 1)
        _setup_logging(config.quiet, f"[rank {rank}/{world}] " if world > 1 else "")
        from .startup import check, starter

        # First: a port in use is said before torch is imported. Under --parallel rank 0 serves alone.
        sock = _bind(config.host, config.port) if rank == 0 else None
        device, dtype = check(config)
        ranks = join(parallel, device) if parallel is not None else None
    except (UsageError, GenerationError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return BAD_INPUT
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return INTERRUPTED
    if ranks is None:
        return serve(config, starter(config, device, dtype), sock)
    start = starter(config, ranks.device, dtype)
    return serve(config, agreed_start(start, ranks), sock) if ranks.leads else follow(start, ranks)
