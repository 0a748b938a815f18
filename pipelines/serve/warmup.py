"""The server's warm-up: every served size at every batch-size bucket, with and without guidance
where the model has it, for every adapter state; timed and measured per bucket.

With ``--quantize``, the first warm-up measures the layers on the largest bucket with the guidance
setting of the model's default call (``measure_cfg``): that of a request that names no guidance.

One ``pipe.accel.warmup`` call per adapter state takes every bucket at once: with ``--compile``
the accelerator then compiles every case before it captures any, so no later bucket's recompile
drops an earlier bucket's graphs, and the largest case is captured first, its pool blocks reused
by the smaller ones. The blocks are compiled with dynamic shapes, so the largest bucket's compile
serves the others (dynamo specialises a size of 1, so bucket 1 compiles once more; measured on
the CPU with the tiny Z-Image: 7 graphs for buckets 1 2 4 and for 1 2 4 8, 5 for 4 alone). Its
report is per size; the server's cost is per bucket, so each pipeline call the warm-up makes is
timed by its batch size (:class:`CallClock`), with the graphs dynamo compiled in it, the graph
memory it added and, on a GPU, its peak memory (which the admission then uses instead of its
estimate). An out-of-memory warm-up ends the start in one line naming the bucket and size it was
at.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pipelines.generation import RunError
from pipelines.memory_estimate import format_bytes

__all__ = ["BucketCost", "CallClock", "WarmUp", "compiled_graphs", "warm_up"]

logger = logging.getLogger("bcg-serve")

Size = tuple[int, int]


@dataclasses.dataclass
class BucketCost:
    """What warming up one bucket cost: seconds (compile included), pipeline calls, graphs dynamo
    compiled, graph memory added, and the largest peak of device memory above what was allocated
    before a call (0 where not measured: a CPU)."""

    batch: int
    seconds: float = 0.0
    calls: int = 0
    compiled: int = 0
    graph_bytes: int = 0
    peak_bytes: int = 0


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (what ``accel``'s warm-up report counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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

    def __init__(self, pipe: Any, graph_bytes: Callable[[], int], device: Any = None) -> None:
        self.pipe = pipe
        self.graph_bytes = graph_bytes
        self.device = device if device is not None and device.type == "cuda" else None
        self.costs: dict[int, BucketCost] = {}
        # The peak of each (batch, (width, height)) the warm-up called, on a GPU.
        self.peaks: dict[tuple[int, Size], int] = {}
        self.current: tuple[int, int | None, int | None] | None = None

    def _start(self) -> int:
        import torch

        if self.device is None:
            return 0
        from accel import reset_peak_memory

        torch.cuda.synchronize(self.device)
        # The library's: a capture resets torch's counters to measure its eager runs.
        reset_peak_memory(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _peak(self, before: int) -> int:
        import torch

        if self.device is None:
            return 0
        from accel import peak_memory

        torch.cuda.synchronize(self.device)
        return max(peak_memory(self.device)[0] - before, 0)

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
            width, height = kwargs.get("width"), kwargs.get("height")
            clock.current = (batch, width, height)
            cost = clock.costs.setdefault(batch, BucketCost(batch))
            held, graphs, allocated = clock.graph_bytes(), compiled_graphs(), clock._start()
            t0 = time.perf_counter()
            out = call(pipe, *args, **kwargs)
            peak = clock._peak(allocated)
            cost.seconds += time.perf_counter() - t0
            cost.calls += 1
            cost.compiled += compiled_graphs() - graphs
            cost.graph_bytes += clock.graph_bytes() - held
            cost.peak_bytes = max(cost.peak_bytes, peak)
            if peak and width is not None and height is not None:
                key = (batch, (int(width), int(height)))
                clock.peaks[key] = max(clock.peaks.get(key, 0), peak)
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
    from pipelines.generation import generation_defaults

    return generation_defaults(pipe).cfg_above


@dataclasses.dataclass
class WarmUp:
    """What the warm-up did: its cost per bucket, whether anything was captured (False where
    graphs do not run: a CPU, mode eager), the measured peaks by (bucket, size) and its seconds."""

    costs: dict[int, BucketCost]
    captured: bool
    peaks: dict[tuple[int, Size], int]
    seconds: float


def warm_up(engine: Any, sizes: Sequence[Size], batch_sizes: Sequence[int]) -> WarmUp:
    """Capture every size at every bucket for every adapter state (none, then each adapter);
    logs each size's and each bucket's cost."""
    import torch

    pipe, d = engine.pipe, engine.prepared.call
    cfg = [True, False] if d.guidance_kwarg is not None and not math.isinf(_cfg_above(pipe)) else [False]
    # --quantize measures the call a request that names no guidance makes (Z-Image's: none), not the
    # first case's (guidance on): guidance multiplies the float8 error into the latents, and measured
    # with it the selection keeps far more layers in bf16 than those calls need (docs/benchmarks.md).
    measure_cfg = d.warm_cfg if d.warm_cfg in cfg else cfg[0]
    kwargs: dict[str, Any] = dict(batch_sizes=sorted(batch_sizes), cfg=cfg, progress=False, measure_cfg=measure_cfg)
    if d.frames is not None:
        kwargs["num_frames"] = d.frames
    if getattr(engine, "needs_image", False):  # an edit model: every call brings an image, the warm-up's too
        from PIL import Image

        from pipelines.generation.image_input import flatten

        # As a request's image reaches the pipeline: RGBA where its VAE reads four channels.
        grey = Image.new("RGB", sizes[0], (128, 128, 128))
        kwargs["call_kwargs"] = {"image": flatten(grey, pipe)}
    clock = CallClock(pipe, pipe.accel.graph_memory_bytes, engine.device)
    captured = False
    names = ", ".join(f"{w}x{h}" for w, h in sizes)
    buckets = " ".join(map(str, sorted(batch_sizes)))
    t0 = time.perf_counter()
    states = [None, *engine.adapters.names()]
    # With compiled blocks each adapter state compiles its own versions of them (peft's flags are
    # guarded), and a version compiled after graphs were captured drops them (GraphHook.follow_weights).
    # Where a later state compiled after an earlier one captured, a second round captures again what
    # that dropped (its calls otherwise replay), so no request captures at its first call.
    compiled_after_capture = False
    for again, lora in itertools.product((False, True), states):
        if again and not compiled_after_capture:
            break
        engine.adapters.select(lora)
        logger.info("warming up %s at batch sizes %s%s%s%s", names, buckets,
                    ", with and without guidance" if len(cfg) == 2 else "", f", adapter {lora!r}" if lora else "",
                    " (again: a later adapter state compiled)" if again else "")  # fmt: skip
        graphs = compiled_graphs()
        try:
            with clock.timing():
                report = pipe.accel.warmup(list(sizes), **kwargs)
        except torch.OutOfMemoryError:
            batch, w, h = clock.current or (max(batch_sizes), None, None)
            where = f" at {w}x{h}" if w is not None else ""
            raise RunError(f"out of memory capturing graphs for batch {batch}{where}: lower --batch-sizes or "
                           "--resolutions (or set --memory-budget below what this device has)") from None  # fmt: skip
        compiled_after_capture = compiled_after_capture or (captured and compiled_graphs() > graphs)
        captured = captured or (report.skipped is None and report.total_captures > 0)
        for i, row in enumerate(report.rows, 1):
            what = report.skipped or f"{row.captures} graph(s), {row.resident_bytes / 2**20:.1f} MiB"
            compiled = f", compile {row.compile_seconds:.2f} s" if row.compile_seconds else ""
            logger.info("warm-up %d/%d: %s: %.2f s%s (%s)", i, len(report.rows), row.size, row.seconds, compiled,
                        what)  # fmt: skip
    engine.adapters.select(None)
    for b in sorted(clock.costs, reverse=True):
        c = clock.costs[b]
        compiled = f", {c.compiled} graph(s) compiled" if c.compiled else ""
        peak = f", peak +{format_bytes(c.peak_bytes)}" if c.peak_bytes else ""
        logger.info("warm-up of batch size %d: %.2f s in %d call(s)%s, graph memory +%s%s", b, c.seconds, c.calls,
                    compiled, format_bytes(max(c.graph_bytes, 0)), peak)  # fmt: skip
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %.2f s in all, graph memory %s", seconds, format_bytes(pipe.accel.graph_memory_bytes()))
    return WarmUp(clock.costs, captured, clock.peaks, seconds)
