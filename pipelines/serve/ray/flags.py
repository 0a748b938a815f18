"""``bcg-serve --ray``'s flags: bcg-serve's own (:mod:`pipelines.serve.config`), read as they are
there, and the Ray flags beside them; Ray Serve's deployment options made of both.

Each value is checked as it is read (one line, exit status 2). What Ray itself checks (an
autoscaling field it does not know, say) is checked by Ray's own config class before anything
is started. Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from ...generation.constants import accel_module
from ..config import PROG, ServeConfig, UsageError, build_parser, parse_args

__all__ = ["RayConfig", "add_ray_arguments", "deployment_options", "parse_ray_args", "replica_ranks"]

RAY_FLAG = "--ray"
# Ray Serve's own default: a replica's LRU keeps this many adapters.
DEFAULT_MODELS_PER_REPLICA = 3


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """The Ray flags. None: derived from bcg-serve's flags (:func:`deployment_options`)."""

    address: str | None = None
    app_name: str = "bcg-serve"
    min_replicas: int = 1
    max_replicas: int | None = None
    initial_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay: float | None = None
    downscale_delay: float | None = None
    autoscaling: tuple[tuple[str, str], ...] = ()
    max_queued_requests: int | None = None
    max_models_per_replica: int = DEFAULT_MODELS_PER_REPLICA
    gpus_per_replica: float | None = None
    cpus_per_replica: float = 1.0
    frontends: int = 1
    retries: int = 2


def _number(low: float, kind: type = float) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {text}")
        return value

    return parse


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE (a field of Ray Serve's autoscaling_config)")
    return key.strip(), value.strip()


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The Ray flags, as one group of ``p``."""
    r = p.add_argument_group("ray (bcg-serve --ray: a Ray Serve application, one replica per GPU)")
    r.add_argument(RAY_FLAG, action="store_true", help="serve as a Ray Serve application (the [ray] extra)")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to join (auto: the one `ray start` started here; default: RAY_ADDRESS, else "
                   "a new cluster on this machine)")  # fmt: skip
    r.add_argument("--app-name", default="bcg-serve", metavar="NAME", help="the Serve application's name")
    r.add_argument("--min-replicas", type=_number(0, int), default=1, metavar="N",
                   help="replicas at least (autoscaling_config.min_replicas; default 1)")  # fmt: skip
    r.add_argument("--max-replicas", type=_number(1, int), default=None, metavar="N",
                   help="replicas at most (autoscaling_config.max_replicas; default --min-replicas, at least 1)")  # fmt: skip
    r.add_argument("--initial-replicas", type=_number(0, int), default=None, metavar="N",
                   help="replicas at start (autoscaling_config.initial_replicas; default --min-replicas)")  # fmt: skip
    r.add_argument("--target-ongoing-requests", type=_number(0.01), default=None, metavar="N",
                   help="requests waiting or running per replica that the autoscaler aims at (default: the "
                   "largest batch size)")  # fmt: skip
    r.add_argument("--upscale-delay", type=_number(0), default=None, metavar="S",
                   help="seconds the load must stay above the target before a replica is added (Ray's default 30)")  # fmt: skip
    r.add_argument("--downscale-delay", type=_number(0), default=None, metavar="S",
                   help="seconds the load must stay below the target before a replica goes (Ray's default 600)")  # fmt: skip
    r.add_argument("--autoscaling", type=_key_value, nargs="+", default=None, metavar="KEY=VALUE",
                   help="any other field of Ray Serve's autoscaling_config (look_back_period_s=10, ...)")  # fmt: skip
    r.add_argument("--max-queued-requests", type=_number(1, int), default=None, metavar="N",
                   help="requests waiting for a replica when every replica is full; beyond, 429 (default --queue)")  # fmt: skip
    r.add_argument("--max-models-per-replica", type=_number(1, int), default=DEFAULT_MODELS_PER_REPLICA,
                   metavar="K", help="LoRA adapters a replica holds at once (its adapter slots; least recently used "
                   f"goes first; default {DEFAULT_MODELS_PER_REPLICA})")  # fmt: skip
    r.add_argument("--gpus-per-replica", type=_number(0), default=None, metavar="G",
                   help="GPUs per replica (ray_actor_options.num_gpus; default 1, 0 with --device cpu); with "
                   "--parallel, one process each (default: the fewest the mode runs on, 2 or 4)")  # fmt: skip
    r.add_argument("--cpus-per-replica", type=_number(0), default=1.0, metavar="C",
                   help="CPUs per replica (ray_actor_options.num_cpus; default 1)")  # fmt: skip
    r.add_argument("--frontends", type=_number(1, int), default=1, metavar="N",
                   help="replicas of the HTTP frontend (no GPU; default 1)")  # fmt: skip
    r.add_argument("--retries", type=_number(0, int), default=2, metavar="N",
                   help="times a request is sent again when its replica died under it (default 2)")  # fmt: skip


def _ray_parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:
            raise UsageError(f"{message} (see {PROG} --ray --help)")

    p = Parser(prog=PROG, add_help=False)
    add_ray_arguments(p)
    return p


def help_text() -> str:
    """``bcg-serve --ray --help``: bcg-serve's flags and the Ray flags."""
    p = build_parser()
    add_ray_arguments(p)
    return p.format_help()


def parse_ray_args(argv: Sequence[str]) -> tuple[ServeConfig, RayConfig, list[str]]:
    """``argv`` (with or without ``--ray``) -> bcg-serve's config, the Ray flags, and the
    bcg-serve flags alone (what each replica reads again). UsageError in one line."""
    args, rest = _ray_parser().parse_known_args(list(argv))
    config = parse_args(rest)
    device = config.settings.device
    if device is not None and device.startswith("cuda:"):
        raise UsageError(f"--device {device}: Ray gives each replica its GPUs; give --device cuda (or cpu)")
    if args.max_replicas is not None and args.max_replicas < args.min_replicas:
        raise UsageError(f"--max-replicas {args.max_replicas} is below --min-replicas {args.min_replicas}")
    gpus = args.gpus_per_replica
    if gpus is not None and gpus > 0 and device == "cpu":
        raise UsageError(f"--gpus-per-replica {gpus:g} with --device cpu: drop one of them")
    if config.settings.parallel is not None:
        replica_ranks(config.settings.parallel, gpus, device)  # checked now: one line before anything starts
        if config.settings.loras:
            raise UsageError("--lora with --ray --parallel: a replica's adapter slots are not kept on its other ranks "
                             "yet; serve adapters from replicas of one GPU")  # fmt: skip
    ray = RayConfig(address=args.ray_address, app_name=args.app_name, min_replicas=args.min_replicas,
                    max_replicas=args.max_replicas, initial_replicas=args.initial_replicas,
                    target_ongoing_requests=args.target_ongoing_requests, upscale_delay=args.upscale_delay,
                    downscale_delay=args.downscale_delay, autoscaling=tuple(args.autoscaling or ()),
                    max_queued_requests=args.max_queued_requests, max_models_per_replica=args.max_models_per_replica,
                    gpus_per_replica=gpus, cpus_per_replica=args.cpus_per_replica, frontends=args.frontends,
                    retries=args.retries)  # fmt: skip
    autoscaling_config(config, ray)  # Ray's own checks, before anything starts
    return config, ray, rest


def replica_ranks(parallel: str | None, gpus: float | None, device: str | None) -> int:
    """The processes of one replica: 1, or with ``--parallel`` one per GPU of ``--gpus-per-replica``
    (default, and on a CPU: the fewest the mode runs on); UsageError where the mode cannot use them.

    How many processes a mode runs on is :mod:`accel.parallel.layout`'s rule, loaded without torch."""
    if parallel is None:
        return 1
    layout = accel_module("accel.parallel.layout")
    if gpus is None or device == "cpu":
        return layout.fewest_ranks(parallel)
    n = int(gpus)
    if n != gpus or not layout.runs_on(parallel, n):
        raise UsageError(f"--parallel {parallel} --gpus-per-replica {gpus:g}: a replica runs one process per GPU and "
                         f"{parallel} needs {layout.ranks_needed(parallel)}")  # fmt: skip
    return n


def autoscaling_config(config: ServeConfig, ray: RayConfig) -> dict[str, Any]:
    """Ray Serve's ``autoscaling_config`` of the flags (checked by Ray's own class)."""
    out: dict[str, Any] = {
        "min_replicas": ray.min_replicas,
        "max_replicas": ray.max_replicas if ray.max_replicas is not None else max(ray.min_replicas, 1),
        # A replica whose largest bucket is full keeps its device busy; more waiting is latency.
        "target_ongoing_requests": ray.target_ongoing_requests or float(config.max_batch),
    }
    if ray.initial_replicas is not None:
        out["initial_replicas"] = ray.initial_replicas
    if ray.upscale_delay is not None:
        out["upscale_delay_s"] = ray.upscale_delay
    if ray.downscale_delay is not None:
        out["downscale_delay_s"] = ray.downscale_delay
    out.update(dict(ray.autoscaling))
    try:
        from ray.serve.config import AutoscalingConfig
    except ImportError:  # checked where the application is deployed
        return out
    fields = getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__
    unknown = sorted(set(out) - set(fields))
    if unknown:  # Ray's class ignores them: a misspelt field would be a setting silently not made
        raise UsageError(f"autoscaling_config: {unknown[0]} is not a field of Ray Serve's autoscaling_config "
                         f"({', '.join(sorted(fields))})")  # fmt: skip
    try:
        AutoscalingConfig(**out)
    except Exception as e:  # pydantic's ValidationError: its first error, in one line
        errors = getattr(e, "errors", None)
        first = errors()[0] if callable(errors) else None
        told = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(e).splitlines()[0]
        raise UsageError(f"autoscaling_config: {told}") from None
    return out


def deployment_options(config: ServeConfig, ray: RayConfig) -> dict[str, Any]:
    """The Generator deployment's options: its resources, its autoscaling, and its admission.

    A replica takes at most its queue's length of requests at once (``max_ongoing_requests``; those
    of its call under way count too, so its own queue never overflows): beyond, Ray keeps the
    request in the handle's queue for another replica, up to ``max_queued_requests``, and then the
    frontend answers 429."""
    gpus = ray.gpus_per_replica
    if gpus is None:
        gpus = 0.0 if config.settings.device == "cpu" else float(replica_ranks(config.settings.parallel, None, None))
    return {
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": ray.cpus_per_replica},
        "autoscaling_config": autoscaling_config(config, ray),
        "max_ongoing_requests": config.queue,
        "max_queued_requests": ray.max_queued_requests if ray.max_queued_requests is not None else config.queue,
        # The warm-up is the replica's start; a health check is cheap (the worker thread alive).
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": config.timeout + 1,
    }
