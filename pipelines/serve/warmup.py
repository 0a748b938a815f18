"""The server's warm-up: every served size at every batch-size bucket, with and without guidance
where the model has it, for every adapter state; timed and measured per bucket.

One ``pipe.accel.warmup`` call per adapter state takes every bucket at once: with ``--compile``
the accelerator then compiles every case before it captures any, so no later bucket's recompile
drops an earlier bucket's graphs, and the largest case is captured first, its pool blocks reused
by the smaller ones. Its report is per size; the server's cost is per bucket, so each pipeline
call the warm-up makes is timed by its batch size (:class:`CallClock`), with the graph memory it
added. An out-of-memory warm-up ends the start in one line naming the bucket and size it was at.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pipelines.cli import RunError
from pipelines.memory_estimate import format_bytes

__all__ = ["BucketCost", "CallClock", "warm_up"]

logger = logging.getLogger("bcg-serve")

Size = tuple[int, int]


@dataclasses.dataclass
class BucketCost:
    """What warming up one bucket cost: seconds (compile included), pipeline calls, graph memory added."""

    batch: int
    seconds: float = 0.0
    calls: int = 0
    graph_bytes: int = 0


def call_batch(kwargs: dict[str, Any]) -> int:
    """Images a pipeline call makes: its prompts (or embeddings) times ``num_images_per_prompt``."""
    rows = 1
    for name in ("prompt", "prompt_embeds"):
        value = kwargs.get(name)
        if isinstance(value, (list, tuple)):
            rows = len(value)
            break
        if hasattr(value, "shape"):
            rows = int(value.shape[0])
            break
    return rows * int(kwargs.get("num_images_per_prompt") or 1)


class CallClock:
    """Times the pipeline calls made under it by their batch size (``costs``), and remembers the
    one in flight (``current``: batch, width, height) for an out-of-memory message.

    The accelerator's warm-up calls the pipeline as ``pipe(**kwargs)``, which Python looks up on
    the class: the class's ``__call__`` is wrapped for the duration, and put back after.
    """

    def __init__(self, pipe: Any, graph_bytes: Callable[[], int], sync: Callable[[], None]) -> None:
        self.pipe = pipe
        self.graph_bytes = graph_bytes
        self.sync = sync
        self.costs: dict[int, BucketCost] = {}
        self.current: tuple[int, int | None, int | None] | None = None

    @contextmanager
    def timing(self) -> Iterator[CallClock]:
        cls = type(self.pipe)
        original = cls.__dict__.get("__call__")
        call = cls.__call__
        clock = self

        @functools.wraps(call)
        def timed(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            if pipe is not clock.pipe:
                return call(pipe, *args, **kwargs)
            batch = call_batch(kwargs)
            clock.current = (batch, kwargs.get("width"), kwargs.get("height"))
            cost = clock.costs.setdefault(batch, BucketCost(batch))
            held, t0 = clock.graph_bytes(), time.perf_counter()
            out = call(pipe, *args, **kwargs)
            clock.sync()
            cost.seconds += time.perf_counter() - t0
            cost.calls += 1
            cost.graph_bytes += clock.graph_bytes() - held
            clock.current = None
            return out

        cls.__call__ = timed
        try:
            yield self
        finally:
            if original is not None:
                cls.__call__ = original
            else:
                del cls.__call__


def _cfg_above(pipe: Any) -> float:
    from pipelines.cli import generation_defaults

    return generation_defaults(pipe).cfg_above


def warm_up(engine: Any, sizes: Sequence[Size], batch_sizes: Sequence[int]) -> tuple[dict[int, BucketCost], bool]:
    """Capture every size at every bucket for every adapter state (none, then each adapter);
    logs each size's and each bucket's cost. Returns the costs by bucket and whether anything
    was captured (False where graphs do not run: a CPU, mode eager)."""
    import torch

    pipe, d = engine.pipe, engine.prepared.call
    cfg = [True, False] if d.guidance_kwarg is not None and not math.isinf(_cfg_above(pipe)) else [False]
    kwargs: dict[str, Any] = dict(batch_sizes=sorted(batch_sizes), cfg=cfg, progress=False)
    if d.frames is not None:
        kwargs["num_frames"] = d.frames
    device = engine.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    clock = CallClock(pipe, pipe.accel.graph_memory_bytes, sync)
    captured = False
    names = ", ".join(f"{w}x{h}" for w, h in sizes)
    buckets = " ".join(map(str, sorted(batch_sizes)))
    t0 = time.perf_counter()
    for lora in (None, *engine.adapters.names()):
        engine.adapters.select(lora)
        logger.info("warming up %s at batch sizes %s%s%s", names, buckets,
                    ", with and without guidance" if len(cfg) == 2 else "", f", adapter {lora!r}" if lora else "")  # fmt: skip
        try:
            with clock.timing():
                report = pipe.accel.warmup(list(sizes), **kwargs)
        except torch.OutOfMemoryError:
            batch, w, h = clock.current or (max(batch_sizes), None, None)
            where = f" at {w}x{h}" if w is not None else ""
            raise RunError(f"out of memory capturing graphs for batch {batch}{where}: lower --batch-sizes or "
                           "--resolutions (or set --memory-budget below what this device has)") from None  # fmt: skip
        captured = captured or (report.skipped is None and report.total_captures > 0)
        for i, row in enumerate(report.rows, 1):
            what = report.skipped or f"{row.captures} graph(s), {row.resident_bytes / 2**20:.1f} MiB"
            compiled = f", compile {row.compile_seconds:.2f} s" if row.compile_seconds else ""
            logger.info("warm-up %d/%d: %s: %.2f s%s (%s)", i, len(report.rows), row.size, row.seconds, compiled,
                        what)  # fmt: skip
    engine.adapters.select(None)
    for b in sorted(clock.costs, reverse=True):
        c = clock.costs[b]
        logger.info("warm-up of batch size %d: %.2f s in %d call(s), graph memory +%s", b, c.seconds, c.calls,
                    format_bytes(max(c.graph_bytes, 0)))  # fmt: skip
    logger.info("warm-up: %.2f s in all, graph memory %s", time.perf_counter() - t0,
                format_bytes(pipe.accel.graph_memory_bytes()))  # fmt: skip
    return clock.costs, captured
