"""``bcg-serve``'s flags: the model flags ``bcg-generate`` takes (from :mod:`pipelines.cli`) and
the server's own.

Each value is checked as it is read; a bad one is one line and exit status 2, before anything is
bound or built. Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pipelines.cli import CLIError, ModelSettings, add_model_arguments, model_settings
from pipelines.cli.model_flags import model_epilog
from pipelines.cli.values import resolution

__all__ = ["PROG", "ServeConfig", "UsageError", "build_parser", "parse_args"]

PROG = "bcg-serve"
DEFAULT_RESOLUTION = "512x512"


class UsageError(Exception):
    """A bad flag or value: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise UsageError(f"{message} (see {PROG} --help)")


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
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``bcg-serve`` argument parser: the model flags, then the server's."""
    p = _Parser(
        prog=PROG,
        description="Serve images over HTTP (OpenAI's POST /v1/images/generations) from a pipeline whose\n"
        "graphs stay warm, joining compatible requests into one pipeline call.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
{model_epilog()}

--lora NAME=FILE[:SCALE]: each adapter is loaded at start (before the accelerator) and none is
  active until a request names one ("lora": NAME); a request without one gets the base model.

POST /v1/images/generations takes JSON: prompt (required), n (1 to --max-batch), size (one of
  --resolutions, default the first), response_format (b64_json), and the extensions seed (image i
  uses seed + i; default random), steps, guidance, negative_prompt, lora (a --lora NAME).
  Also: GET /v1/models, /health, /ready (200 once warmed up), /metrics (Prometheus).

--warmup: the sizes captured before the server is ready (default: --resolutions; 'none': none),
  each at every batch size up to --max-batch, with and without guidance where the model has it.

One server owns one device: for several GPUs, start one server per GPU (--device cuda:N, --port)
behind your load balancer. SIGTERM stops accepting, finishes the running batch, answers the
waiting requests 503 and exits 0.
exit status: 0 stopped, 1 the model failed to load or warm up, 2 bad input, 130 interrupted.""",
    )
    add_model_arguments(p)
    s = p.add_argument_group("server")
    s.add_argument("--resolutions", type=resolution, nargs="+", default=None, metavar="WxH",
                   help=f"the sizes served, WIDTHxHEIGHT; the first is a request's default (default "
                   f"{DEFAULT_RESOLUTION})")  # fmt: skip
    s.add_argument(
        "--max-batch",
        type=_int_at_least(1),
        default=4,
        metavar="N",
        help="images per pipeline call at most, and per request (n) (default 4; 1: no batching)",
    )
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


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The parsed flags: the model's (:class:`pipelines.cli.ModelSettings`) and the server's."""

    settings: ModelSettings
    resolutions: tuple[tuple[int, int], ...]
    max_batch: int = 4
    max_wait: float = 0.02
    queue: int = 64
    timeout: float = 300.0
    host: str = "127.0.0.1"
    port: int = 8000
    quiet: bool = False


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    """``argv`` -> :class:`ServeConfig`, or :class:`UsageError` (``--help`` exits as argparse does)."""
    args = build_parser().parse_args(argv)
    try:
        settings = model_settings(args)
    except CLIError as e:
        raise UsageError(str(e)) from None
    if settings.parallel is not None:
        raise UsageError(f"--parallel {settings.parallel} computes each image on several processes; bcg-serve "
                         "serves from one device: start one server per GPU instead")  # fmt: skip
    names = [spec.name for spec in settings.loras]
    if None in names:
        raise UsageError("--lora takes NAME=FILE[:SCALE] here: a request picks its adapter by that name")
    if len(set(names)) != len(names):
        raise UsageError(f"--lora: each adapter needs a name of its own, got {', '.join(map(str, names))}")
    sizes = tuple(dict.fromkeys(args.resolutions or [resolution(DEFAULT_RESOLUTION)]))
    return ServeConfig(settings=settings, resolutions=sizes, max_batch=args.max_batch,
                       max_wait=args.max_wait_ms / 1000, queue=args.queue, timeout=args.timeout, host=args.host,
                       port=args.port, quiet=args.quiet)  # fmt: skip
