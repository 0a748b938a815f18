"""``bcg-serve``'s flags: the model's (as ``bcg-generate`` takes them) and the server's.

Each value is checked as it is read; a bad one is one line and exit status 2, before torch is
imported or anything is bound or built.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["PROG", "ServeConfig", "UsageError", "build_parser", "parse_args"]

PROG = "bcg-serve"
DEFAULT_RESOLUTION = "512x512"


class UsageError(Exception):
    """A bad flag or value: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise UsageError(f"{message} (see {PROG} --help)")


def _resolution(text: str) -> tuple[int, int]:
    from pipelines.cli.arguments import accel_options

    try:
        return accel_options().parse_resolution(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``bcg-serve`` argument parser."""
    p = _Parser(
        prog=PROG,
        description="Serve images over HTTP (OpenAI's POST /v1/images/generations) from a pipeline whose "
        "graphs stay warm, joining compatible requests into one pipeline call.",
        epilog="One server owns one device: for several GPUs, start one server per GPU (--device cuda:N, "
        "--port) behind your load balancer. SIGTERM stops accepting, finishes the running batch, answers "
        "the waiting requests 503 and exits 0.",
    )
    _add_model_flags(p)
    s = p.add_argument_group("server")
    s.add_argument("--resolutions", type=_resolution, nargs="+", default=None, metavar="WxH",
                   help=f"the sizes served, each warmed up before the server is ready; the first is the default "
                   f"(default {DEFAULT_RESOLUTION})")  # fmt: skip
    s.add_argument("--max-batch", type=_int_at_least(1), default=4, metavar="N",
                   help="images per pipeline call at most, and per request (n); every batch size up to N is "
                   "warmed up (default 4; 1 turns batching off)")  # fmt: skip
    s.add_argument(
        "--max-wait-ms",
        type=_int_at_least(0),
        default=20,
        metavar="MS",
        help="how long the oldest waiting request may wait for others to join its call (default 20)",
    )
    s.add_argument(
        "--queue",
        type=_int_at_least(1),
        default=64,
        metavar="N",
        help="requests waiting at most; beyond, 429 with Retry-After (default 64)",
    )
    s.add_argument("--timeout", type=_seconds, default=300.0, metavar="S",
                   help="seconds a request may take from arrival to answer; beyond, 504 and its work is dropped "
                   "(default 300)")  # fmt: skip
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    s.add_argument("--quiet", action="store_true", help="only warnings and errors in the log")
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", default="z-image", help="a built-in model, a pipeline folder or a hub id")
    m.add_argument("--size", choices=("tiny", "full"), default="tiny", help="size of the built-in models")
    m.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    m.add_argument("--dtype", default=None, help="weights dtype (default bfloat16 on cuda, float32 on cpu)")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The parsed flags: ``args`` (the model's, for the model builder) and the server's."""

    args: argparse.Namespace
    resolutions: tuple[tuple[int, int], ...]
    max_batch: int
    max_wait: float
    queue: int
    timeout: float
    host: str
    port: int
    quiet: bool


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    """``argv`` -> :class:`ServeConfig`, or :class:`UsageError` (``--help`` exits as argparse does)."""
    args = build_parser().parse_args(argv)
    sizes = tuple(dict.fromkeys(args.resolutions or [_resolution(DEFAULT_RESOLUTION)]))
    return ServeConfig(args=args, resolutions=sizes, max_batch=args.max_batch, max_wait=args.max_wait_ms / 1000,
                       queue=args.queue, timeout=args.timeout, host=args.host, port=args.port,
                       quiet=args.quiet)  # fmt: skip
