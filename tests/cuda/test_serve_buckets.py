"""bcg-serve's batch-size buckets and fast paths on a GPU (bf16, CUDA graphs), through the engine
its start builds (the flags, the warm-up, the admission):

* full-size Z-Image at 512x512 with ``--compile``, buckets 1 2 4 8: the warm-up's time and
  compiled graphs per bucket are printed (the blocks compile with dynamic shapes: buckets 4 and 2
  reuse bucket 8's compile); a request's images equal it in any other call of its bucket, bit for
  bit (padded rows or other requests beside it, another order), and every call replays; whether
  it also equals the request made at another bucket (alone: bucket 1; in a pair: bucket 2) is
  compared and printed, not assumed;
* the same with ``--quantize fp8`` (compute capability 8.9 or newer, torchao);
* a step cache (First Block Cache on the tiny Qwen-Image-style model) and a LoRA (the tiny
  Z-Image-style model): bit for bit within a bucket, replayed.

Run with ``-s`` to see the printed lines (docs/serving.md records them).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.serve.config import parse_args
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import check, starter
from tests.pipelines.serve.server import decode, make_lora

pytestmark = pytest.mark.cuda

FULL = ["--model", "z-image", "--size", "full", "--resolutions", "512x512", "--batch-sizes", "1", "2", "4", "8",
        "--device", "cuda"]  # fmt: skip
PROMPTS = ["a red fox", "a sailboat on a lake", "a cat on a mat", "an owl at night", "a snowy peak", "a blue door"]


def start(argv: list[str]) -> Engine:
    config = parse_args(argv)
    return starter(config, *check(config))()


def made(engine: Engine, requests: list[ImageRequest]) -> list[list[np.ndarray]]:
    out = engine.run([engine.plan(r) for r in requests])
    return [[np.asarray(decode(g.b64_json)).astype(int) for g in images] for images in out]


def gap(a: np.ndarray, b: np.ndarray) -> str:
    d = np.abs(a - b)
    return "bit for bit" if not d.any() else f"max {int(d.max())}, mean {float(d.mean()):.3f} levels"


def check_buckets(engine: Engine, size: tuple[int, int], steps: int, what: str, lora: str | None = None) -> None:
    """Bit for bit within buckets 4 (and 8 where served), every call replayed; the gaps to
    buckets 1 and 2 printed."""

    def req(i: int, n: int = 1) -> ImageRequest:
        return ImageRequest(PROMPTS[i], n, *size, seed=100 + 7 * i, steps=steps, lora=lora)

    x, pair, y, z, w, v = req(0), req(1, 2), req(2), req(3), req(4), req(5)
    keys = {engine.plan(r).key for r in (x, pair, y, z, w, v)}
    assert len(keys) == 1, f"{what}: the prompts fall in several text cases: {keys}"
    replays, eager = engine.denoiser_counts()
    padded = made(engine, [x, pair])  # 3 images: bucket 4, one row padded
    full = made(engine, [y, z, x, w])  # 4 images, x third
    again = made(engine, [pair, x])  # 3 images, another order
    assert np.array_equal(padded[0][0], full[2][0]), f"{what}: x padded against x among others, bucket 4"
    assert np.array_equal(padded[0][0], again[1][0]) and np.array_equal(padded[1][1], again[0][1]), what
    assert not np.array_equal(padded[0][0], full[0][0])  # other seeds, other images: the check can fail
    if 8 in (engine.batch_sizes or ()):
        eight = made(engine, [y, x, pair, z])  # 5 images: bucket 8
        other = made(engine, [x, w, v, pair, z, y])  # 7 images: bucket 8
        assert np.array_equal(eight[1][0], other[0][0]), f"{what}: x in two calls of bucket 8"
    after = engine.denoiser_counts()
    assert after[1] == eager and after[0] > replays, f"{what}: a bucket's call ran its denoiser eagerly"
    alone = made(engine, [x])[0][0]  # bucket 1
    two = made(engine, [x, y])[0][0]  # bucket 2
    sys.stderr.write(f"{what}: x at bucket 1 against bucket 4: {gap(alone, padded[0][0])}; at bucket 2 against "
                     f"bucket 4: {gap(two, padded[0][0])}; bucket 1 against 2: {gap(alone, two)}\n")  # fmt: skip


def report_warm_up(engine: Engine, what: str) -> None:
    costs = engine.warmup_costs
    lines = [f"batch {b}: {c.seconds:.1f} s, {c.calls} calls, {c.compiled} graphs compiled, graph memory "
             f"+{c.graph_bytes / 2**20:.0f} MiB, peak +{c.peak_bytes / 2**20:.0f} MiB"
             for b, c in sorted(costs.items(), reverse=True)]  # fmt: skip
    sys.stderr.write(f"{what}: warm-up {engine.warmup_seconds:.1f} s; " + "; ".join(lines) + "\n")


@pytest.fixture(scope="module")
def compiled() -> Iterator[Engine]:
    engine = start([*FULL, "--compile"])
    yield engine
    engine.pipe.accel.restore()


def test_compiled_buckets_are_bit_for_bit_within_a_bucket(compiled: Engine) -> None:
    report_warm_up(compiled, "z-image full 512 --compile")
    costs = compiled.warmup_costs
    assert sorted(costs) == [1, 2, 4, 8]
    assert costs[8].compiled > 0 and costs[4].compiled == costs[2].compiled == 0, "a bucket compiled again"
    check_buckets(compiled, (512, 512), 9, "z-image full 512 --compile")


def test_fp8_buckets_are_bit_for_bit_within_a_bucket() -> None:
    pytest.importorskip("torchao")
    from accel.hooks.fp8 import quantizers

    if torch.cuda.get_device_capability() < quantizers.MIN_FP8_CAPABILITY:
        pytest.skip("float8 products need compute capability 8.9 or newer")
    engine = start([*FULL, "--compile", "--quantize", "fp8"])
    try:
        assert engine.pipe.accel.quantization is not None
        report_warm_up(engine, "z-image full 512 --compile --quantize fp8")
        check_buckets(engine, (512, 512), 9, "z-image full 512 --compile --quantize fp8")
    finally:
        engine.pipe.accel.restore()


def test_a_step_cache_under_buckets() -> None:
    engine = start(["--model", "qwen-image", "--resolutions", "256x256", "--batch-sizes", "1", "2", "4",
                    "--cache", "fbc", "--cache-threshold", "10", "--device", "cuda"])  # fmt: skip
    try:
        stats = engine.pipe.accel.stats()["transformer"]
        assert any(len(paths) == 2 for paths in stats.paths_per_entry), stats.paths_per_entry  # the cached path
        check_buckets(engine, (256, 256), 4, "qwen-image tiny 256 --cache fbc")
    finally:
        engine.pipe.accel.restore()


def test_a_lora_under_buckets(tmp_path: Path) -> None:
    lora = make_lora(tmp_path)
    engine = start(["--model", "z-image", "--resolutions", "256x256", "--batch-sizes", "1", "2", "4",
                    "--lora", f"style={lora}", "--device", "cuda"])  # fmt: skip
    try:
        check_buckets(engine, (256, 256), 4, "z-image tiny 256 --lora", lora="style")
        base = made(engine, [ImageRequest(PROMPTS[0], 1, 256, 256, seed=1, steps=4)])[0][0]
        styled = made(engine, [ImageRequest(PROMPTS[0], 1, 256, 256, seed=1, steps=4, lora="style")])[0][0]
        assert not np.array_equal(base, styled)
    finally:
        engine.pipe.accel.restore()
