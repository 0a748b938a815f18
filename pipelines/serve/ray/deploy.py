"""The Ray Serve application: bound from the flags, run on a Ray cluster, stopped on a signal.

``bcg-serve --ray`` joins the cluster at ``--ray-address`` (``auto``: the one ``ray start`` started
here; else ``RAY_ADDRESS``; else it starts one on this machine), starts Serve's HTTP proxy on ``--host``/``--port``, deploys the application
(:func:`build_app`) and returns once every replica has warmed up; SIGTERM or Ctrl-C deletes the
application (Ray drains each replica's requests first) and exits 0 (130 after Ctrl-C). The same
application is ``serve run pipelines.serve.ray_app:build argv='...'`` or a KubeRay ``RayService``'s
``import_path`` (docs/serving-ray.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..config import PROG, UsageError
from .flags import deployment_options, help_text, parse_ray_args, replica_ranks

__all__ = ["build_app", "main"]

logger = logging.getLogger("bcg-serve")

BAD_INPUT = 2
INTERRUPTED = 130


def build_app(argv: Sequence[str]) -> Any:
    """The application of bcg-serve's and the Ray flags ``argv`` (UsageError in one line)."""
    from ray import serve

    from .frontend import frontend_class
    from .replica import generator_class

    config, ray, serve_argv = parse_ray_args(argv)
    options = deployment_options(config, ray)
    generator = serve.deployment(generator_class(ray.max_models_per_replica), name="Generator", **options)
    # The frontend only reads, checks and forwards: no GPU, no CPU reserved, and room for every
    # request the replicas and the handle's queue can hold.
    most = options["autoscaling_config"]["max_replicas"] * options["max_ongoing_requests"]
    frontend = serve.deployment(frontend_class(), name="Frontend", num_replicas=ray.frontends,
                                ray_actor_options={"num_cpus": 0},
                                max_ongoing_requests=most + options["max_queued_requests"] + 16)  # fmt: skip
    ranks = replica_ranks(config.settings.parallel, ray.gpus_per_replica, config.settings.device)
    return frontend.bind(generator.bind(serve_argv, ranks), serve_argv, ray.retries)


_START_FAILED = "bcg-serve replica could not start: "


def _why_not(app_name: str) -> str | None:
    """The first replica's failure of ``app_name``'s deployments, in one line (a replica's start
    says ``bcg-serve replica could not start: ...``), or None."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # the controller went away: Ray's own error is all there is
        return None
    for deployment in app.deployments.values() if app is not None else ():
        # The traceback's last line is the error (its source line, above it, holds the words too).
        told = [line for line in (deployment.message or "").splitlines() if "Error: " + _START_FAILED in line]
        if told:
            return told[-1].split(_START_FAILED, 1)[1].strip()[:300]
    return None


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """Run ``bcg-serve --ray``; returns the exit status (0 stopped, 1 failed to deploy, 2 bad
    input, 130 interrupted)."""
    from pipelines.generation.errors import GenerationError
    from pipelines.generation.extras import require

    if "-h" in argv or "--help" in argv:
        sys.stdout.write(help_text())
        return 0
    try:
        config, ray_config, _ = parse_ray_args(argv)
        require("serve", PROG)
        require("ray", f"{PROG} --ray")
        app = build_app(argv)
    except (UsageError, GenerationError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return BAD_INPUT
    _setup_logging(config.quiet)
    import ray
    from ray import serve

    # A cluster joined keeps running, with its other applications; one started here goes. Without
    # an address Ray would join the cluster `ray start` last started here: "local" starts one.
    joined = ray_config.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    ray.init(address=None if joined and not ray_config.address else ray_config.address or "local",
             logging_level=logging.WARNING)  # fmt: skip
    stop = threading.Event()
    interrupted = []

    def on_signal(signum: int, frame: Any) -> None:
        interrupted.append(signum == signal.SIGINT)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        logger.info("listening on http://%s:%d (warming up the replicas; GET /ready answers 200 when one is done)",
                    config.host, config.port)  # fmt: skip
        try:
            serve.run(app, name=ray_config.app_name, route_prefix="/", blocking=False)
        except Exception as e:  # a replica that cannot start: its reason is in the deployment's status
            logger.error("could not deploy: %s", _why_not(ray_config.app_name) or str(e).strip().splitlines()[-1][:300])
            return 1
        logger.info("ready: application %r, replicas %s", ray_config.app_name,
                    deployment_options(config, ray_config)["autoscaling_config"])  # fmt: skip
        stop.wait()
        logger.info("stopping: the replicas finish their requests")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        serve.delete(ray_config.app_name)
        if not joined:
            serve.shutdown()
        ray.shutdown()
    logger.info("stopped")
    return INTERRUPTED if interrupted and interrupted[-1] else 0
