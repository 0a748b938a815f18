"""bcg-serve's engine on a GPU (full-size Z-Image, bf16, graphs): batches replay the graphs the
server's warm-up captured, and an image made in a batch equals the same request in another
batch of the same size bit for bit; against the request alone (another batch size, another
graph) the gap is measured and printed for docs/serving.md."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pipelines.serve.config import parse_args
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import check, starter
from tests.pipelines.serve.server import decode

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = parse_args(["--model", "z-image", "--size", "full", "--resolutions", "512x512", "--max-batch", "4",
                         "--device", "cuda"])  # fmt: skip
    return starter(config, *check(config))()


def made(engine: Engine, requests: list[ImageRequest]) -> list[list[np.ndarray]]:
    out = engine.run([engine.plan(r) for r in requests])
    return [[np.asarray(decode(g.b64_json)).astype(int) for g in images] for images in out]


def test_batches_replay_and_equal_the_same_request_in_a_batch_of_the_same_size(engine: Engine) -> None:
    def req(prompt: str, n: int, seed: int) -> ImageRequest:
        return ImageRequest(prompt, n, 512, 512, seed=seed, steps=2)

    a, b, c, c2 = req("a red fox", 2, 10), req("a sailboat on a lake", 1, 3), req("a cat", 1, 7), req("a dog", 1, 7)
    assert len({engine.plan(r).key for r in (a, b, c, c2)}) == 1
    replays = engine.denoiser_counts()[0]
    four = made(engine, [a, b, c])
    assert engine.denoiser_counts()[0] > replays  # the warm-up's batch-4 graph, not an eager call
    again = made(engine, [c2, b, a])[::-1]  # [a, b, c2]: other order, c's place taken by another prompt
    for x, y in zip(four[:2], again[:2]):
        assert all(np.array_equal(i, j) for i, j in zip(x, y))
    alone = [made(engine, [r])[0] for r in (a, b, c)]
    gaps = [int(np.abs(i - j).max()) for x, y in zip(alone, four) for i, j in zip(x, y)]
    means = [float(np.abs(i - j).mean()) for x, y in zip(alone, four) for i, j in zip(x, y)]
    sys.stderr.write(f"z-image full bf16 512x512: alone against a batch of 4, max 8-bit diff per image {gaps}, "
                     f"mean {[round(m, 3) for m in means]}\n")  # fmt: skip


def test_a_call_stopped_at_a_step_leaves_the_graphs_to_replay_the_next_bit_for_bit(engine: Engine) -> None:
    """A server stops a call whose requests all gave up at a step's end (diffusers'
    callback_on_step_end raises out of the call): on real graphs the next calls replay and give
    the images they gave before the stop, bit for bit."""
    from pipelines.generation import CallStopped

    request = ImageRequest("a lighthouse at night", 1, 512, 512, seed=21, steps=8)
    before = made(engine, [request])
    steps: list[int] = []

    def stop() -> bool:
        steps.append(1)
        return len(steps) >= 3

    with pytest.raises(CallStopped):
        engine.make([engine.plan(request)], stop)
    assert len(steps) == 3  # stopped at the third step's end, not at the last
    replays = engine.denoiser_counts()[0]
    after = made(engine, [request])
    assert engine.denoiser_counts()[0] > replays
    assert all(np.array_equal(x, y) for x, y in zip(before[0], after[0]))
