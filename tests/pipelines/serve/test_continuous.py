"""--batching continuous on the CPU, graphs emulated (tests/helpers/emulator.py): requests join
running batches at step boundaries and leave when their own steps are done, and each image equals
the same request made in a pipeline call of its bucket (Engine.make), bit for bit, whatever its
neighbours, their steps, guidance, seeds and sizes; every denoiser call after the warm-up a replay.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pipelines.cli import ModelSettings, Workload, prepare_pipeline
from pipelines.cli.prepare import resolve_device_and_dtype
from pipelines.serve.batcher import Batcher, Work
from pipelines.serve.continuous import ContinuousWorker
from pipelines.serve.engine import Engine
from pipelines.serve.metrics import Metrics
from pipelines.serve.schema import ImageRequest
from pipelines.stepwise.family import steps_for
from tests.pipelines.serve.test_buckets import prompt_of_warm_length

SIZES = ((32, 32), (64, 32))


def continuous_engine(model: str, buckets: tuple[int, ...], sizes: tuple[tuple[int, int], ...] = SIZES,
                      **settings: Any) -> Engine:  # fmt: skip
    s = ModelSettings(model=model, device="cpu", warmup=(), **settings)
    device, dtype = resolve_device_and_dtype(s)
    prepared = prepare_pipeline(s, Workload(resolutions=list(sizes), prompts=("x",)), device, dtype, progress=False)
    engine = Engine(prepared, buckets)
    engine.steps = steps_for(prepared.pipe)
    # The shortest of the recipe's text lengths only (the prompts' here): the server's warm-up takes
    # all four, more graphs than a runner keeps (32) at two sizes and two buckets with and without guidance.
    shortest = min(engine.pipe.accel.recipes["transformer"].default_prompt_lengths())
    report = engine.pipe.accel.warmup(list(sizes), batch_sizes=buckets, cfg=[True, False], prompt_lengths=[shortest],
                                      progress=False)  # fmt: skip
    assert report.total_captures > 0
    return engine


class Running:
    """A continuous worker around ``engine``, its batcher and metrics; stopped at the end."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        self.batcher = Batcher(256, max_batch, 0.0)
        self.metrics = Metrics(max_batch, lambda: self.batcher.depth, engine.batch_sizes)
        ready = threading.Event()
        self.worker = ContinuousWorker(self.batcher, self.metrics, lambda: engine, lambda e: ready.set(),
                                       lambda e: None)  # fmt: skip
        self.worker.start()
        assert ready.wait(10)
        self.engine = engine

    def submit(self, request: ImageRequest) -> Work:
        plan = self.engine.plan(request)
        work = Work(plan.key, request.n, plan)
        self.batcher.submit(work)
        return work

    def close(self) -> None:
        self.batcher.close()
        self.worker.join(60)
        assert not self.worker.is_alive()


@pytest.fixture
def running() -> Iterator[list[Running]]:
    made: list[Running] = []
    yield made
    for r in made:
        r.close()


def pixels(made: list[Any]) -> list[np.ndarray]:
    return [np.asarray(m.image) for m in made]


def static(engine: Engine, request: ImageRequest, bucket: int) -> list[np.ndarray]:
    """``request``'s images in a pipeline call of ``bucket`` rows (copies of it as company)."""
    plan = engine.plan(request)
    copies = -(-bucket // request.n) if bucket > request.n else 1
    made = engine.make([plan] * copies)
    assert engine.bucket(sum(len(p.seeds) for p in [plan] * copies)) == bucket
    return pixels(made[0])


def test_a_request_equals_itself_in_a_static_batch_of_its_bucket_whatever_joins_when(
    emulated: pytest.MonkeyPatch, running: list[Running]
) -> None:
    seed = int(os.environ.get("SEED") or random.randrange(10**6))
    rng = random.Random(seed)
    engine = continuous_engine("z-image", (1, 2, 4))
    recipe = next(iter(engine.pipe.accel.recipes.values()))
    prompts = {size: [prompt_of_warm_length(engine.pipe, recipe, rng, size) for _ in range(3)] for size in SIZES}
    run = Running(engine, 4)
    running.append(run)
    counts = engine.denoiser_counts()
    requests, works = [], []
    for _ in range(10):
        size = rng.choice(SIZES)
        r = ImageRequest(rng.choice(prompts[size]), rng.choice((1, 1, 2)), *size, seed=rng.randrange(10**6),
                         steps=rng.choice((1, 2, 3, 4)), guidance=rng.choice((0.0, 0.0, 2.5, 4.0)))  # fmt: skip
        requests.append(r)
        works.append(run.submit(r))
        if rng.random() < 0.5:
            works[-1].future.result(60)  # later requests join a batch under way, or an idle worker
    answers = [w.future.result(60) for w in works]
    after = engine.denoiser_counts()
    assert after[1] == counts[1] and after[0] > counts[0], f"seed {seed}: a step ran eagerly"
    for r, w, made in zip(requests, works, answers):
        assert len(made) == r.n and [m.seed for m in made] == list(w.plan.seeds)
        mine, ref = pixels(made), static(engine, r, w.bucket)
        assert all(np.array_equal(a, b) for a, b in zip(mine, ref)), f"seed {seed}: {r} at bucket {w.bucket}"
