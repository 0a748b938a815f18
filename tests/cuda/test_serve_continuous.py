"""``bcg-serve --batching continuous`` on a GPU (bf16, CUDA graphs), through the engine its start
builds (the flags, the warm-up of buckets 1 2 4 8, the step loop of the family):

* full-size Z-Image at 512x512 with ``--compile``: A (3 images, 9 steps) opens a running batch of
  bucket 4; B (1 image, 5 steps) takes its free slot at A's fourth step and C (1 image, 9 steps) the
  slot B leaves; each image equals its request made by a pipeline call of 4 rows (Engine.make, the
  request and copies of it), bit for bit, and every step replays a graph (B leaves alone: its
  decode is at bucket 1 where the worker finds the decoder keeps each row's bits, and the line
  printed says which); a streamed request
  gets 2 previews and the very image it gets unstreamed;
* the same with ``--quantize fp8`` (compute capability 8.9 or newer, torchao);
* the tiny Qwen-Image-style model at 256x256, true CFG, each row its own scale: bit for bit.

Run with ``-s`` to see the printed lines (docs/serving.md records them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pipelines.serve.config import parse_args
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import check, starter
from tests.pipelines.serve.test_continuous import Gate, Running, pixels, static

pytestmark = pytest.mark.cuda

FULL = ["--model", "z-image", "--size", "full", "--resolutions", "512x512", "--batch-sizes", "1", "2", "4", "8",
        "--device", "cuda", "--batching", "continuous"]  # fmt: skip
PROMPTS = ["a red fox in the snow", "a cat on a mat by a door", "an owl on a branch at night"]


def start(argv: list[str]) -> Engine:
    config = parse_args(argv)
    engine = starter(config, *check(config))()
    assert engine.steps is not None
    return engine


def check_joins(engine: Engine, size: tuple[int, int], steps: int, what: str, guidance: tuple[float, ...]) -> None:
    """A opens bucket 4 with a free slot, B takes it under way, C the slot B leaves: each image
    bit for bit its pipeline call's at bucket 4; every step a replay."""
    keys = {engine.plan(ImageRequest(p, 1, *size, steps=steps)).key.text for p in PROMPTS}
    assert len(keys) == 1, f"{what}: the prompts fall in several text cases: {keys}"
    run = Running(engine, 4, start=False)
    gate = Gate(run)
    run.start()
    try:
        gate.rounds(0)
        request = {
            "a": ImageRequest(PROMPTS[0], 3, *size, seed=10, steps=steps, guidance=guidance[0]),
            "b": ImageRequest(PROMPTS[1], 1, *size, seed=20, steps=steps - 4, guidance=guidance[1]),
            "c": ImageRequest(PROMPTS[2], 1, *size, seed=30, steps=steps, guidance=guidance[2]),
        }
        replays, eager = engine.denoiser_counts()
        work = {"a": run.submit(request["a"])}
        gate.rounds(3)
        work["b"] = run.submit(request["b"])
        gate.rounds(steps - 4)  # B's steps are done: its slot is free
        work["c"] = run.submit(request["c"])
        t0 = time.perf_counter()
        gate.open()
        made = {k: w.future.result(600) for k, w in work.items()}
        seconds = time.perf_counter() - t0
        after = engine.denoiser_counts()
        assert after[1] == eager and after[0] > replays, f"{what}: a step ran its denoiser eagerly"
        assert [[len(batch) for batch in held] for held in gate.held[3:5]] == [[4], [4]], gate.held
        for k, m in made.items():
            assert work[k].bucket == 4
            ref = static(engine, request[k], 4)
            mine = pixels(m)
            assert all(np.array_equal(a, b) for a, b in zip(mine, ref)), f"{what}: {k} against its pipeline call"
        found = run.worker._invariant.get(size)  # the largest bucket it holds up to (0: none; None: not checked)
        sys.stderr.write(f"{what}: A, B and C bit for bit their pipeline calls of 4 rows; C's steps after A left "
                         f"took {seconds:.2f} s; the decoder keeps each row's bits up to bucket {found}\n")  # fmt: skip
    finally:
        gate.open()
        run.close()


def check_stream(engine: Engine, size: tuple[int, int], steps: int, what: str) -> None:
    """A streamed request: 2 previews at evenly spaced steps, and the image the same request gets
    without streaming, bit for bit."""
    run = Running(engine, 4, start=False)
    made = run.worker._preview
    took: list[float] = []

    def timed(preview: object) -> None:  # a preview's decode, conversion and hand-over, timed on the device
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        made(preview)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)

    run.worker._preview = timed  # type: ignore[method-assign]
    run.start()
    try:
        plain = ImageRequest(PROMPTS[0], 1, *size, seed=5, steps=steps)
        streamed = ImageRequest(PROMPTS[0], 1, *size, seed=5, steps=steps, stream=True, partial_images=2)
        previews: list[tuple[int, object]] = []
        work = run.submit(streamed, partial=lambda step, image: previews.append((step, image)))
        got = pixels(work.future.result(600))
        again = pixels(run.submit(plain).future.result(600))
        assert [s for s, _ in previews] == [steps // 3, 2 * steps // 3], previews
        assert np.array_equal(got[0], again[0]), f"{what}: the streamed image against the same request unstreamed"
        ms = ", ".join(f"{1000 * t:.1f}" for t in took)
        sys.stderr.write(f"{what}: 2 previews (after steps {[s + 1 for s, _ in previews]}: {ms} ms each, decode and "
                         "8-bit image on the device), final bit for bit\n")  # fmt: skip
    finally:
        run.close()


@pytest.fixture(scope="module")
def compiled() -> Iterator[Engine]:
    engine = start([*FULL, "--compile"])
    yield engine
    engine.pipe.accel.restore()


def test_continuous_batching_is_bit_for_bit_its_bucket_compiled(compiled: Engine) -> None:
    sys.stderr.write(f"z-image full 512 --compile: warm-up {compiled.warmup_seconds:.1f} s\n")
    check_joins(compiled, (512, 512), 9, "z-image full 512 --compile", (0.0, 0.0, 0.0))
    check_stream(compiled, (512, 512), 9, "z-image full 512 --compile")


def test_continuous_batching_is_bit_for_bit_its_bucket_fp8() -> None:
    pytest.importorskip("torchao")
    from accel.hooks.fp8 import quantizers

    if torch.cuda.get_device_capability() < quantizers.MIN_FP8_CAPABILITY:
        pytest.skip("float8 products need compute capability 8.9 or newer")
    engine = start([*FULL, "--compile", "--quantize", "fp8"])
    try:
        assert engine.pipe.accel.quantization is not None
        check_joins(engine, (512, 512), 9, "z-image full 512 --compile --quantize fp8", (0.0, 0.0, 0.0))
    finally:
        engine.pipe.accel.restore()


def test_true_cfg_rows_with_their_own_scales() -> None:
    engine = start(["--model", "qwen-image", "--resolutions", "256x256", "--batch-sizes", "1", "2", "4",
                    "--device", "cuda", "--batching", "continuous"])  # fmt: skip
    try:
        check_joins(engine, (256, 256), 8, "qwen-image tiny 256, true CFG", (4.0, 2.5, 6.0))
    finally:
        engine.pipe.accel.restore()
