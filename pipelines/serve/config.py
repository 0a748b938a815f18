"""``bcg-serve``'s flags: the model flags ``bcg-generate`` takes (:mod:`pipelines.generation.model_flags`) and
the server's own.

Each value is checked as it is read; a bad one is one line and exit status 2, before anything is
bound or built. Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pipelines.families.catalog import known_model
from pipelines.generation import InputError, ModelSettings, add_model_arguments, model_settings
from pipelines.generation.constants import MAX_STEPS
from pipelines.generation.model_flags import model_epilog
from pipelines.generation.values import at_least, positive, resolution

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "PROG",
    "ServeConfig",
    "UsageError",
    "batch_sizes",
    "build_parser",
    "graphs_kept",
    "parse_args",
    "served_names",
]

PROG = "bcg-serve"
# What OpenAI's clients and the tools built on them ask for when they name no size.
DEFAULT_RESOLUTION = "1024x1024"
# The most steps a request may ask for unless --max-steps says otherwise: above every built-in
# model's default (9 to 50), far below the 1000 a scheduler could take, which would hold the device
# for minutes.
DEFAULT_MAX_STEPS = 100
# The batch sizes captured when neither --batch-sizes nor --max-batch is given. Each bucket costs
# warm-up time and graph memory, and larger calls gain less per image than their memory costs
# (docs/serving.md), so buckets above 4 are a measured choice, not a default.
DEFAULT_BATCH_SIZES = (1, 2, 4)
# How requests share the device: whole pipeline calls of compatible requests (dynamic), or rows of
# running batches that requests join and leave at step boundaries (continuous, :mod:`.continuous`).
BATCHING = ("dynamic", "continuous")


class UsageError(Exception):
    """A bad flag or value: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise UsageError(f"{message} (see {PROG} --help)")


def _seconds(text: str) -> float:
    return positive(text, "seconds")


def _gib(text: str) -> int:
    return int(positive(text, "GiB") * 2**30)


# Graphs a denoiser keeps per size, bucket and adapter state the warm-up captures: its text lengths,
# guidance on and off, steps (tiny Z-Image: 9); the library's own default for a whole denoiser.
GRAPHS_PER_CASE = 32


def graphs_kept(sizes: int, buckets: int, adapters: int) -> int:
    """Graphs each denoiser keeps: room for all the warm-up captures (no adapter and each of
    ``adapters``, every size at every bucket), so none is evicted and captured again by a request."""
    return GRAPHS_PER_CASE * sizes * buckets * (1 + adapters)


def batch_sizes(given: list[int] | None, max_batch: int | None) -> tuple[int, ...]:
    """The buckets of ``--batch-sizes`` and ``--max-batch``, ascending; UsageError where they disagree."""
    if given is not None:
        sizes = tuple(sorted(set(given)))
        if max_batch is not None and max_batch != sizes[-1]:
            raise UsageError(f"--max-batch {max_batch} is not the largest of --batch-sizes "
                             f"{' '.join(map(str, sizes))}: drop --max-batch")  # fmt: skip
        return sizes
    if max_batch is None:
        return DEFAULT_BATCH_SIZES
    below = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return (*below, max_batch)


def _steps(text: str) -> int:
    value = at_least(1)(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_STEPS} (the schedulers' num_train_timesteps), got {value}")
    return value


def _model_name(text: str) -> str:
    name = text.strip()
    if not name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"{text!r}: a model name is one word without spaces")
    return name


def served_names(model: str, given: list[str] | None) -> tuple[str, ...]:
    """The names the model is served under, its id first: ``--served-model-name``'s, else a built-in
    model's name and its aliases, a folder's name (its path too), a hub id (its name part too). A
    request's ``model`` may give any of them; ``/v1/models`` lists the first."""
    if given:
        return tuple(dict.fromkeys(given))
    known = known_model(model)
    if known is not None:
        return (known.name, *known.aliases)
    path = Path(model).expanduser()
    if path.is_dir():
        return tuple(dict.fromkeys([path.resolve().name, model]))
    return tuple(dict.fromkeys([model, model.rsplit("/", 1)[-1]]))


def _port(text: str) -> int:
    value = at_least(0)(text)
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

POST /v1/images/generations takes OpenAI's JSON: prompt (required), n (1 to the largest batch
  size), size (one of --resolutions, default the first), response_format (b64_json),
  output_format (png, jpeg, webp), output_compression (0-100, jpeg and webp); quality, style,
  background, moderation and OpenAI's other fields are accepted and ignored (said in the log and
  the X-Ignored-Parameters header); and the extensions seed (image i uses seed + i; default
  random), steps, guidance, negative_prompt, lora (a --lora NAME).
  An invalid request is a 400 in OpenAI's error shape (its client raises BadRequestError).
POST /v1/images/edits takes OpenAI's multipart form (image, prompt, mask, n, size, ...) for a
  model that takes an image: an edit pipeline, or the image-to-image pipeline diffusers makes from
  a text-to-image one (the same weights and graphs; strength, an extension, 0 to 1).
  Also: GET /v1/models, /v1/models/{id}, /health, /ready (200 while a request would be taken
  now: warmed up, the queue not full, no call past --timeout), /metrics (Prometheus). Every
  request leaves one access-log line (id, status, model, size, steps, queue/device/encode ms).

--warmup: the sizes captured before the server is ready (default: --resolutions; 'none': none),
  each at every --batch-sizes bucket, with and without guidance where the model has it. Where
  graphs are captured, a request for a size not warmed up is a 422 naming the sizes served,
  unless --capture-on-miss (then its first call captures).

--batch-sizes: the buckets a pipeline call runs at (default {" ".join(map(str, DEFAULT_BATCH_SIZES))}). A call of k images
  runs at the smallest bucket of at least k; the rows added to reach it repeat the last image and
  are dropped. --max-batch N alone means the buckets 1 2 4 ... below N, and N.

--batching continuous: requests join running batches (one per size, bucket and text case) at the
  next step boundary and leave them, decoded and answered, when their own steps are done; each
  keeps its own steps, guidance and seed, and its image is bit for bit the one a pipeline call of
  its bucket makes. Streaming (stream, partial_images 0-3) needs it. --batching dynamic (the
  default) joins whole pipeline calls.

--timeout: a request not answered in time is a 504; a pipeline call whose requests have all
  given up (timed out, or their clients left) stops at the end of its current step, so the
  requests behind it wait one step, not the whole call.

One server owns one device: for several GPUs, --ray serves as a Ray Serve application, one
replica per GPU (bcg-serve --ray --help; docs/serving-ray.md). --parallel under torchrun (or
accelerate launch) makes each image on every process: rank 0 serves HTTP, the others follow its
calls (dynamic batching only). SIGTERM stops accepting, finishes the running batch, answers the
waiting requests 503 and exits 0. It serves images: a video model is refused at start.
exit status: 0 stopped, 1 the model failed to load or warm up, 2 bad input, 130 interrupted.""",
    )
    add_model_arguments(p, named_loras=True)
    s = p.add_argument_group("server")
    s.add_argument("--resolutions", type=resolution, nargs="+", default=None, metavar="WxH",
                   help=f"the sizes served, WIDTHxHEIGHT; the first is a request's default (default "
                   f"{DEFAULT_RESOLUTION}, what OpenAI's clients ask for)")  # fmt: skip
    s.add_argument("--served-model-name", type=_model_name, nargs="+", default=None, metavar="NAME",
                   help="the model's id in /v1/models and answers, then other names a request's model may give "
                   "(default: a built-in model's name and aliases, a folder's name, a hub id)")  # fmt: skip
    s.add_argument("--max-steps", type=_steps, default=DEFAULT_MAX_STEPS, metavar="N",
                   help=f"the most steps a request may ask for (default {DEFAULT_MAX_STEPS}; up to {MAX_STEPS})")  # fmt: skip
    s.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=None, metavar="N",
                   help="the batch sizes captured and run; the largest is the most images per call and per request "
                   f"(n) (default {' '.join(map(str, DEFAULT_BATCH_SIZES))}; 1: no batching)")  # fmt: skip
    s.add_argument(
        "--max-batch",
        type=at_least(1),
        default=None,
        metavar="N",
        help="the largest batch size (the buckets below it are 1 2 4 ...); --batch-sizes names them all",
    )
    s.add_argument("--batching", choices=BATCHING, default="dynamic",
                   help="dynamic: requests that can share a pipeline call are joined into one (default); "
                   "continuous: requests join running batches at step boundaries (and may stream)")  # fmt: skip
    s.add_argument("--capture-on-miss", action="store_true",
                   help="serve a --resolutions size that --warmup left out by capturing it on its first call "
                   "(default: a 422 naming the sizes warmed up)")  # fmt: skip
    s.add_argument("--memory-budget", type=_gib, default=None, metavar="GIB",
                   help="device memory the calls and graphs may use beyond the weights (default: what the device "
                   "has free once they are loaded; none on a CPU)")  # fmt: skip
    s.add_argument(
        "--max-wait-ms",
        type=at_least(0),
        default=20,
        metavar="MS",
        help="how long the oldest waiting request may wait for others to join its call (default 20)",
    )
    s.add_argument(
        "--queue",
        type=at_least(1),
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
    """The parsed flags: the model's (:class:`pipelines.generation.ModelSettings`) and the server's."""

    settings: ModelSettings
    resolutions: tuple[tuple[int, int], ...]
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    max_wait: float = 0.02
    queue: int = 64
    timeout: float = 300.0
    host: str = "127.0.0.1"
    port: int = 8000
    quiet: bool = False
    capture_on_miss: bool = False
    memory_budget: int | None = None
    names: tuple[str, ...] = ()
    max_steps: int = DEFAULT_MAX_STEPS
    batching: str = "dynamic"

    @property
    def max_batch(self) -> int:
        """The largest bucket: images per call, and per request, at most."""
        return self.batch_sizes[-1]


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    """``argv`` -> :class:`ServeConfig`, or :class:`UsageError` (``--help`` exits as argparse does)."""
    args = build_parser().parse_args(argv)
    try:
        settings = model_settings(args)
    except InputError as e:
        raise UsageError(str(e)) from None
    known = known_model(settings.model)
    if known is not None and known.video:
        raise UsageError(f"--model {settings.model} makes videos and bcg-serve serves images (OpenAI's images API): "
                         "use bcg-generate for videos")  # fmt: skip
    names = [spec.name for spec in settings.loras]
    if None in names:
        raise UsageError("--lora takes NAME=FILE[:SCALE] here: a request picks its adapter by that name")
    if len(set(names)) != len(names):
        raise UsageError(f"--lora: each adapter needs a name of its own, got {', '.join(map(str, names))}")
    sizes = tuple(dict.fromkeys(args.resolutions or [resolution(DEFAULT_RESOLUTION)]))
    buckets = batch_sizes(args.batch_sizes, args.max_batch)
    settings = dataclasses.replace(settings, max_entries=graphs_kept(len(sizes), len(buckets), len(settings.loras)))
    if args.capture_on_miss and settings.mode == "eager":
        raise UsageError("--capture-on-miss captures graphs, which --mode eager never does: drop one of them")
    if args.batching == "continuous" and settings.cache is not None:
        raise UsageError(f"--cache {args.cache} decides per pipeline call (its residuals and step counts are the "
                         "whole batch's), not per row: drop it for --batching continuous")  # fmt: skip
    if args.batching == "continuous" and settings.parallel is not None:
        raise UsageError(f"--batching continuous steps its running batches in one process: serve --parallel "
                         f"{settings.parallel} with --batching dynamic")  # fmt: skip
    return ServeConfig(settings=settings, resolutions=sizes, batch_sizes=buckets,
                       max_wait=args.max_wait_ms / 1000, queue=args.queue, timeout=args.timeout, host=args.host,
                       port=args.port, quiet=args.quiet, capture_on_miss=args.capture_on_miss,
                       memory_budget=args.memory_budget, names=served_names(settings.model, args.served_model_name),
                       max_steps=args.max_steps, batching=args.batching)  # fmt: skip
