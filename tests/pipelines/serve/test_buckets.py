"""Batch-size buckets through the server's engine, with CUDA graphs emulated on the CPU
(tests/helpers/emulator.py): the warm-up captures the buckets only, timed per bucket; a batch of
k images runs at the smallest bucket of at least k, replaying that bucket's graphs; the padded
rows are dropped; and an image equals the same request made in any other call of its bucket, bit
for bit, whether the other rows are padding or other requests. Against the request made at
another bucket (other shapes, other kernels' blocking) the gap is measured and printed.

The fast paths under batching keep all of that: a LoRA (a warm-up per adapter state), a step
cache (qwen-image, First Block Cache, its cached path captured) and compiled blocks (dynamo with
dynamic shapes: the largest bucket's compile serves the others, and serving compiles nothing).
``--quantize fp8`` cannot run on a CPU: its flags reach the accelerator, and a CPU is refused in
one line (tests/cuda/test_serve_buckets.py runs it on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipelines.generation import InputError, ModelSettings, Workload, prepare_pipeline
from pipelines.generation.caches import cache_request
from pipelines.generation.prepare import resolve_device_and_dtype
from pipelines.lora import LoraSpec
from pipelines.serve.config import parse_args
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import ServeSettings, check
from pipelines.serve.warmup import compiled_graphs, warm_up
from tests.pipelines.serve.server import decode, make_lora

SIZE = (32, 32)
BUCKETS = (1, 2, 4)


class Calls:
    """Counts the rows of every call of the pipeline's class (the padded ones included)."""

    def __init__(self, pipe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        call = type(pipe).__call__

        @functools.wraps(call)
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.rows.append(len(kwargs["prompt"]))
            return call(*args, **kwargs)

        monkeypatch.setattr(type(pipe), "__call__", counting)


def warm_engine(model: str, buckets: tuple[int, ...] = BUCKETS, **settings: Any) -> tuple[Engine, dict[int, Any]]:
    s = ModelSettings(model=model, device="cpu", warmup=(), **settings)
    device, dtype = resolve_device_and_dtype(s)
    prepared = prepare_pipeline(s, Workload(resolutions=[SIZE], prompts=("x",)), device, dtype, progress=False)
    engine = Engine(prepared, buckets)
    warm = warm_up(engine, [SIZE], buckets)
    assert warm.captured
    return engine, warm.costs


def pixels(engine: Engine, requests: list[ImageRequest]) -> list[list[np.ndarray]]:
    out = engine.run([engine.plan(r) for r in requests])
    return [[np.asarray(decode(g.b64_json)) for g in images] for images in out]


WORDS = ["fox", "cat", "owl", "elk", "yak", "emu", "red", "blue", "snow", "lake", "tall", "old", "in", "the"]


def warm_prompt(engine: Engine, rng: random.Random) -> str:
    """A random prompt whose text reaches the denoiser at a length the warm-up captured.

    On a CPU the recipes do not pad text to their lengths (that serves graph sharing, and graphs
    are CUDA's), so a call replays a warm-up graph only where its prompt's own length is one."""
    recipe = next(iter(engine.pipe.accel.recipes.values()))
    return prompt_of_warm_length(engine.pipe, recipe, rng, SIZE)


def prompt_of_warm_length(pipe: Any, recipe: Any, rng: random.Random, size: tuple[int, int]) -> str:
    """A random prompt of the shortest text length ``recipe``'s warm-up captures at ``size``."""
    target = min(recipe.warmup_length(n, *size) for n in recipe.default_prompt_lengths())
    words: list[str] = []
    for _ in range(10_000):
        words.append(rng.choice(WORDS))
        (n,) = recipe.prompt_lengths(pipe, [" ".join(words)])
        if n == target:
            return " ".join(words)
        if n > target:
            words = []
    raise AssertionError(f"no prompt of {target} tokens found")


def requests(engine: Engine, rng: random.Random, lora: str | None = None) -> list[ImageRequest]:
    """Five requests of one text case, random prompts and seeds."""

    def req(n: int) -> ImageRequest:
        return ImageRequest(warm_prompt(engine, rng), n, *SIZE, seed=rng.randrange(10**6), steps=2, lora=lora)

    return [req(1), req(2), req(1), req(1), req(1)]


def check_buckets(engine: Engine, calls: Calls, rng: random.Random, lora: str | None = None) -> None:
    """Three calls at bucket 4 (padded, full, padded in another order): each image equal across
    them, every denoiser call a replay; then one request alone at bucket 1, its gap printed."""
    x, pair, y, z, w = requests(engine, rng, lora)
    assert len({engine.plan(r).key for r in (x, pair, y, z, w)}) == 1  # one call may hold them all
    replays, eager = engine.denoiser_counts()
    calls.rows.clear()
    padded = pixels(engine, [x, pair])  # 3 images: bucket 4, one padded row
    full = pixels(engine, [y, z, x, w])  # 4 images, x among others
    again = pixels(engine, [pair, x])  # 3 images again, another order
    assert calls.rows == [4, 4, 4]  # every call ran at bucket 4
    assert [len(images) for images in padded] == [1, 2] and [len(images) for images in again] == [2, 1]
    assert np.array_equal(padded[0][0], full[2][0]), "x: padded company against real company, same bucket"
    assert np.array_equal(padded[0][0], again[1][0]) and np.array_equal(padded[1][1], again[0][1])
    assert not np.array_equal(padded[0][0], full[0][0])  # other seeds, other images: the check can fail
    after = engine.denoiser_counts()
    assert after[1] == eager and after[0] > replays, "a bucket's call ran eagerly instead of replaying"
    # Another bucket is another graph: measured, not promised.
    calls.rows.clear()
    alone = pixels(engine, [x])[0][0]
    assert calls.rows == [1]
    gap = int(np.abs(alone.astype(int) - padded[0][0].astype(int)).max())
    sys.stderr.write(f"bucket 1 against bucket 4 (lora {lora}): max 8-bit difference {gap}\n")


def test_buckets_are_warmed_up_padded_and_bit_for_bit_within_a_bucket(emulated: pytest.MonkeyPatch) -> None:
    seed = random.randrange(10**6)
    engine, costs = warm_engine("z-image")
    assert sorted(costs) == list(BUCKETS)  # only the buckets were captured: no batch of 3
    assert all(c.seconds > 0 and c.calls > 0 for c in costs.values())
    assert costs[4].graph_bytes > 0  # the largest bucket is captured first and holds its buffers
    captures = engine.pipe.accel.stats()["transformer"].captures
    check_buckets(engine, Calls(engine.pipe, emulated), random.Random(seed))
    assert engine.pipe.accel.stats()["transformer"].captures == captures, f"seed {seed}: captured while serving"


def test_a_served_call_reads_no_allocator_snapshot(emulated: pytest.MonkeyPatch) -> None:
    """Counting what a call replayed read the allocator's snapshot for every runner, before and
    after every call, and the graph-memory gauge once more per batch: 16 snapshots a request,
    which a one-client p50 waited for (H100, Z-Image 512, compiled: 469 ms against the pipeline's
    336). Counters come without it; the gauge is read when /metrics is scraped, one per pool."""
    from accel.graphs.runner import GraphRunner

    engine, _ = warm_engine("z-image", buckets=(1,))
    reads: list[tuple[bool, bool]] = []
    stats = GraphRunner.stats

    def counting(runner: GraphRunner, memory: bool = True, *, pool: bool = True) -> Any:
        reads.append((memory, pool))
        return stats(runner, memory, pool=pool)

    emulated.setattr(GraphRunner, "stats", counting)
    replays = engine.denoiser_counts()[0]
    engine.run([engine.plan(ImageRequest(warm_prompt(engine, random.Random(0)), 1, *SIZE, seed=1, steps=2))])
    assert engine.denoiser_counts()[0] > replays
    assert reads and all(not memory for memory, _ in reads), reads
    reads.clear()
    engine.graph_memory_bytes()
    assert reads and all(not pool for _, pool in reads), reads  # the pool's bytes read once, apart


def test_graph_memory_is_read_again_only_when_the_graphs_change(emulated: pytest.MonkeyPatch) -> None:
    """The admission asks for the graph memory before every call (twice: the batcher's room, the
    worker's limit), and on a GPU the pool's bytes are the allocator's snapshot, milliseconds a
    read: an H100's lone request waited 8.7 ms in the queue for it. Replays change none of it, so
    it is read again only after graphs were captured or released."""
    from tests.helpers.fakes import FakePool

    reads: list[int] = []
    resident = FakePool.resident_bytes

    def counting(pool: FakePool) -> int:
        reads.append(1)
        return resident(pool)

    emulated.setattr(FakePool, "resident_bytes", counting)
    emulated.setattr(FakePool, "resident", 3 << 20)
    engine, _ = warm_engine("z-image", buckets=(1,))  # its clock reads the graph memory around every call
    assert reads
    reads.clear()
    held = engine.graph_memory_bytes()
    assert held >= 3 << 20
    replays = engine.denoiser_counts()[0]
    engine.run([engine.plan(ImageRequest(warm_prompt(engine, random.Random(0)), 1, *SIZE, seed=1, steps=2))])
    assert engine.denoiser_counts()[0] > replays
    assert [engine.graph_memory_bytes() for _ in range(3)] == [held] * 3
    assert not reads  # nothing was captured or released since the warm-up's last read
    assert engine.pipe.accel.hooks["transformer"].runner.release() > 0
    emulated.setattr(FakePool, "resident", 1 << 20)  # what the pool keeps once the graphs are gone
    after = engine.graph_memory_bytes()
    assert len(reads) == 1 and after < held


def test_a_lora_under_buckets(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seed = random.randrange(10**6)
    spec = LoraSpec(path=make_lora(tmp_path), scale=1.0, name="style")
    engine, _ = warm_engine("z-image", loras=(spec,))
    calls = Calls(engine.pipe, emulated)
    check_buckets(engine, calls, random.Random(seed), lora="style")
    base = pixels(engine, [requests(engine, random.Random(seed))[0]])[0][0]
    styled = pixels(engine, [requests(engine, random.Random(seed), "style")[0]])[0][0]
    assert not np.array_equal(base, styled), f"seed {seed}: the adapter changed nothing"


def test_a_step_cache_under_buckets(emulated: pytest.MonkeyPatch) -> None:
    seed = random.randrange(10**6)
    # A threshold this high skips steps on random weights: the cached path is taken and captured.
    engine, _ = warm_engine("qwen-image", cache=cache_request("fbc", 10.0, None, None))
    stats = engine.pipe.accel.stats()["transformer"]
    assert stats.paths_per_entry and all(len(paths) == 2 for paths in stats.paths_per_entry), stats.paths_per_entry
    misses = stats.path_misses
    check_buckets(engine, Calls(engine.pipe, emulated), random.Random(seed))
    # Both decisions had graphs from the warm-up: serving never took a path without one.
    assert engine.pipe.accel.stats()["transformer"].path_misses == misses, f"seed {seed}"


@pytest.fixture
def compiled(emulated: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``compile=True`` on the CPU: dynamo with dynamic shapes, as on a GPU, but its eager backend
    (inductor's kernels are the GPU test's), without ``fullgraph`` (dynamo steps aside inside the
    emulator's recording, a dispatch mode, so a capture records the blocks' own operations, the
    same the eager backend runs), and the CUDA random state it saves around a trace left alone
    (the emulator says CUDA is there; torch here has none). Returns the compile cache folder."""
    import accel.hooks.compiled.compile as compile_mod

    emulated.setattr(compile_mod, "why_not_compiled", lambda module: None)
    emulated.setattr(compile_mod, "COMPILE_OPTIONS", dict(fullgraph=False, dynamic=True, backend="eager"))
    emulated.setattr(torch.cuda, "get_rng_state", lambda *a, **k: None)
    emulated.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)
    torch._dynamo.reset()
    yield tmp_path / "kernels"
    torch._dynamo.reset()  # compiled code holds the modules it was compiled for


def test_compiled_blocks_under_buckets_compile_once_for_the_batches(emulated: pytest.MonkeyPatch,
                                                                    compiled: Path) -> None:  # fmt: skip
    seed = random.randrange(10**6)
    engine, costs = warm_engine("z-image", (1, 2, 4, 8), compile=True, compile_cache=compiled)
    assert engine.pipe.accel.options.compile
    # The warm-up runs the largest bucket first; its compile (dynamic batch) serves 4 and 2.
    # Dynamo specialises a size of 1, so bucket 1 compiles again.
    per_bucket = {b: c.compiled for b, c in sorted(costs.items())}
    assert costs[8].compiled > 0 and costs[4].compiled == costs[2].compiled == 0, per_bucket
    sys.stderr.write(f"graphs compiled per bucket: {per_bucket}\n")
    before = compiled_graphs()
    check_buckets(engine, Calls(engine.pipe, emulated), random.Random(seed))
    assert compiled_graphs() == before, f"seed {seed}: serving compiled again"


def test_fp8_reaches_the_accelerator_and_a_cpu_is_refused_in_one_line() -> None:
    config = parse_args(["--quantize", "fp8", "--compile", "--device", "cpu", "--batch-sizes", "1", "2", "4", "8"])
    fields = {f.name: getattr(config.settings, f.name) for f in dataclasses.fields(ModelSettings)}
    options = ServeSettings(**fields, capture_on_miss=True).accelerate_options()
    assert (options["quantize"], options["compile"], options["capture_on_miss"]) == ("fp8", True, True)
    with pytest.raises(InputError) as refused:
        check(config)
    assert "--quantize fp8" in str(refused.value) and "\n" not in str(refused.value)
