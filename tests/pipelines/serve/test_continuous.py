"""--batching continuous on the CPU, graphs emulated (tests/helpers/emulator.py): requests join
running batches at step boundaries and leave when their own steps are done, and each image equals
the same request made in a pipeline call of its bucket (Engine.make), bit for bit, whatever its
neighbours, their steps, guidance, seeds and sizes; every denoiser call after the warm-up a replay.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pipelines.generation import ModelSettings, Workload, prepare_pipeline
from pipelines.generation.prepare import resolve_device_and_dtype
from pipelines.serve.batcher import Batcher, Work
from pipelines.serve.continuous import ContinuousWorker
from pipelines.serve.engine import Engine
from pipelines.serve.metrics import Metrics
from pipelines.serve.schema import ImageRequest
from pipelines.serve.worker import RequestGone
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
    for lora in (None, *engine.adapters.names()):  # one warm-up per adapter state, as the server's
        engine.adapters.select(lora)
        report = engine.pipe.accel.warmup(list(sizes), batch_sizes=buckets, cfg=[True, False],
                                          prompt_lengths=[shortest], progress=False)  # fmt: skip
        assert report.total_captures > 0
    engine.adapters.select(None)
    return engine


class Running:
    """A continuous worker around ``engine``, its batcher and metrics; stopped at the end."""

    def __init__(self, engine: Engine, max_batch: int, start: bool = True, max_wait: float = 0.0) -> None:
        self.batcher = Batcher(256, max_batch, max_wait)
        self.metrics = Metrics(max_batch, lambda: self.batcher.depth, engine.batch_sizes)
        self.ready = threading.Event()
        self.worker = ContinuousWorker(self.batcher, self.metrics, lambda: engine, lambda e: self.ready.set(),
                                       lambda e: None)  # fmt: skip
        self.engine = engine
        if start:
            self.start()

    def start(self) -> None:
        self.worker.start()
        assert self.ready.wait(10)

    def submit(self, request: ImageRequest, partial: Any = None) -> Work:
        plan = self.engine.plan(request)
        work = Work(plan.key, request.n, plan, partial=partial)
        self.batcher.submit(work)
        return work

    def close(self) -> None:
        if not self.worker.is_alive():
            return
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
    copies = max(1, bucket // request.n)
    made = engine.make([plan] * copies)
    assert engine.bucket(sum(len(p.seeds) for p in [plan] * copies)) == bucket
    return pixels(made[0])


@pytest.mark.parametrize("model", ["z-image", "qwen-image"])
def test_a_request_equals_itself_in_a_static_batch_of_its_bucket_whatever_joins_when(
    emulated: pytest.MonkeyPatch, running: list[Running], model: str
) -> None:
    seed = int(os.environ.get("SEED") or random.randrange(10**6))
    rng = random.Random(seed)
    engine = continuous_engine(model, (1, 2, 4))
    recipe = next(iter(engine.pipe.accel.recipes.values()))
    prompts = {size: [prompt_of_warm_length(engine.pipe, recipe, rng, size) for _ in range(3)] for size in SIZES}
    run = Running(engine, 4)
    running.append(run)
    counts = engine.denoiser_counts()
    requests, works = [], []
    for _ in range(10):
        size = rng.choice(SIZES)
        r = ImageRequest(rng.choice(prompts[size]), rng.choice((1, 1, 2)), *size, seed=rng.randrange(10**6),
                         steps=rng.choice((2, 3, 4)), guidance=rng.choice((0.0, 0.0, 2.5, 4.0)))  # fmt: skip
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


class Gate:
    """Holds ``run``'s worker at each step boundary, before it takes what waits, until the test
    lets it go on (:meth:`rounds`); records what each round's batches held: per batch, in slot
    order, the step each row was at."""

    def __init__(self, run: Running) -> None:
        self.cond = threading.Condition()
        self.allowed = self.arrived = 0
        self.held: list[list[list[int]]] = []
        worker, take, step = run.worker, run.batcher.take, run.worker._round

        def gated_take(room: int, timeout: float | None = 0.0, gather: bool = False) -> Any:
            with self.cond:
                self.arrived += 1
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.allowed >= self.arrived)
            return take(room, timeout, gather)

        def recorded() -> None:
            self.held.append([[r.schedule.index for r in b.rows] for b in worker.batches if b.rows])
            step()

        run.batcher.take = gated_take  # type: ignore[method-assign]
        worker._round = recorded  # type: ignore[method-assign]

    def rounds(self, k: int) -> None:
        """Let ``k`` boundaries and their rounds pass; returns with the worker at the next boundary."""
        with self.cond:
            self.allowed += k
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.arrived > self.allowed, timeout=60)

    def open(self) -> None:
        with self.cond:
            self.allowed = 10**9
            self.cond.notify_all()


def test_a_request_joins_a_batch_under_way_leaves_before_it_and_one_gone_frees_its_slot(
    emulated: pytest.MonkeyPatch, running: list[Running]
) -> None:
    """Bucket 4 only: A (3 images, 4 steps) opens a batch with a free slot; B (1 image, 3 steps,
    other guidance and seed) takes it at A's third step and leaves after A; C and D take A's
    slots, D gives up after one step and E takes a slot. Each image equals its request in a
    pipeline call of 4 rows, bit for bit."""
    rng = random.Random(5)
    engine = continuous_engine("z-image", (4,), sizes=((32, 32),))
    recipe = engine.pipe.accel.recipes["transformer"]
    prompt = [prompt_of_warm_length(engine.pipe, recipe, rng, (32, 32)) for _ in range(3)]
    run = Running(engine, 4, start=False)
    running.append(run)
    gate = Gate(run)
    run.start()
    request = {
        "a": ImageRequest(prompt[0], 3, 32, 32, seed=10, steps=4, guidance=3.0),
        "b": ImageRequest(prompt[1], 1, 32, 32, seed=20, steps=3, guidance=1.5),
        "c": ImageRequest(prompt[2], 1, 32, 32, seed=30, steps=3, guidance=5.0),
        "d": ImageRequest(prompt[0], 1, 32, 32, seed=40, steps=3, guidance=2.0),
        "e": ImageRequest(prompt[1], 1, 32, 32, seed=50, steps=2, guidance=2.0),
    }
    gate.rounds(0)  # the worker waits at its first boundary
    work = {"a": run.submit(request["a"])}
    gate.rounds(2)
    work["b"] = run.submit(request["b"])
    gate.rounds(2)  # B joins at A's third step; A's fourth is its last
    assert work["a"].future.result(30) and not work["b"].future.done()
    work["c"] = run.submit(request["c"])
    work["d"] = run.submit(request["d"])
    gate.rounds(1)  # B's last step, C's and D's first
    work["d"].gone = True
    work["e"] = run.submit(request["e"])
    gate.open()
    answers = {k: w.future.result(30) for k, w in work.items() if k != "d"}
    with pytest.raises(RequestGone):
        work["d"].future.result(30)
    # D, given up at the boundary after its first step, leaves at the one after (its slot freed).
    assert gate.held == [[[0, 0, 0]], [[1, 1, 1]], [[2, 2, 2, 0]], [[3, 3, 3, 1]], [[0, 0, 2]], [[1, 1, 0]], [[2, 1]]]
    for k, made in answers.items():
        assert all(np.array_equal(a, b) for a, b in zip(pixels(made), static(engine, request[k], 4))), k


def test_batches_take_their_steps_first_come_first_served(emulated: pytest.MonkeyPatch, running: list[Running]) -> None:
    """A (1 image) runs alone at bucket 1; B, come after A's first step, opens a batch of its own
    and waits: the device steps the batch holding the oldest request, so A finishes first (its
    latency is its own steps, not shared), then B runs. Both equal their pipeline calls."""
    rng = random.Random(6)
    engine = continuous_engine("z-image", (1, 2), sizes=((32, 32),))
    prompt = prompt_of_warm_length(engine.pipe, engine.pipe.accel.recipes["transformer"], rng, (32, 32))
    run = Running(engine, 2, start=False)
    running.append(run)
    gate = Gate(run)
    run.start()
    gate.rounds(0)
    request = {
        "a": ImageRequest(prompt, 1, 32, 32, seed=1, steps=3),
        "b": ImageRequest(prompt, 1, 32, 32, seed=2, steps=2),
    }
    work = {"a": run.submit(request["a"])}
    gate.rounds(1)
    work["b"] = run.submit(request["b"])
    gate.open()
    made = {k: w.future.result(30) for k, w in work.items()}
    assert gate.held == [[[0]], [[1], [0]], [[2], [0]], [[0]], [[1]]]
    assert work["a"].bucket == work["b"].bucket == 1
    for k, m in made.items():
        assert all(np.array_equal(a, b) for a, b in zip(pixels(m), static(engine, request[k], 1))), k


def test_a_burst_on_an_idle_worker_opens_one_batch_as_a_dynamic_one_would(
    emulated: pytest.MonkeyPatch, running: list[Running]
) -> None:
    """Four requests arriving 20 ms apart at an idle worker (``max_wait`` 0.5 s): the first waits
    for company as a dynamic batch does, so all four open one batch at bucket 4 (taken as they
    came, the first would open a batch of 1 and the rest another: groups that never merge again),
    each image equal to its pipeline call of that bucket."""
    rng = random.Random(8)
    engine = continuous_engine("z-image", (1, 2, 4), sizes=((32, 32),))
    prompt = prompt_of_warm_length(engine.pipe, engine.pipe.accel.recipes["transformer"], rng, (32, 32))
    run = Running(engine, 4, max_wait=0.5)
    running.append(run)
    requests = [ImageRequest(prompt, 1, 32, 32, seed=10 + i, steps=2) for i in range(4)]
    works = []
    for r in requests:
        works.append(run.submit(r))
        time.sleep(0.02)
    made = [w.future.result(60) for w in works]
    assert [w.bucket for w in works] == [4, 4, 4, 4]
    for r, m in zip(requests, made):
        assert all(np.array_equal(a, b) for a, b in zip(pixels(m), static(engine, r, 4)))


def test_a_steps_wait_for_the_device_counts_as_its_device_time(
    emulated: pytest.MonkeyPatch, running: list[Running]
) -> None:
    """On a GPU the worker waits, after queueing a step, for the step before it (``_pace``); that
    wait is the device's time and is counted in the request's device seconds, not left to "the
    rest" of its latency. A CPU has no wait: here one is made, 50 ms a step."""
    import time

    engine = continuous_engine("z-image", (1,), sizes=((32, 32),))
    waits: list[float] = []

    def pace(self: ContinuousWorker) -> None:
        time.sleep(0.05)
        waits.append(0.05)

    emulated.setattr(ContinuousWorker, "_pace", pace)
    run = Running(engine, 1)
    running.append(run)
    run.submit(ImageRequest("a red fox", 1, 32, 32, seed=1, steps=3)).future.result(30)
    assert len(waits) == 3  # one a step
    assert run.metrics.registry.get_sample_value("bcg_serve_device_seconds_sum") >= sum(waits)


@pytest.mark.parametrize("checked", ["found", "other bits"])
def test_rows_leaving_before_their_batch_decode_at_the_smallest_bucket_only_where_the_bits_stay(
    emulated: pytest.MonkeyPatch, running: list[Running], checked: str
) -> None:
    """A, B and C (1 image each; 2, 4 and 3 steps) open one batch of bucket 4 and leave it one by
    one. Where the decoder gives each row the same bits at every bucket (as the worker finds out
    itself, once, at its start: "found", a decoder made to decode each row alone), each leaves in
    a decode of bucket 1; where it does not ("other bits": the check made to say so), in one of
    bucket 4. Each image equals its request in a pipeline call
    of 4 rows, bit for bit, either way."""
    from pipelines.serve import continuous

    rng = random.Random(7)
    if checked == "found":
        # The tiny decoder on the CPU is not batch-invariant (oneDNN's convolutions and the
        # GroupNorm kernel split their work by the batch): made one that is, the same in the
        # pipeline calls of the reference.
        from diffusers import AutoencoderKL
        from diffusers.models.autoencoders.vae import DecoderOutput

        whole = AutoencoderKL.decode

        def per_row(self: Any, z: Any, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
            rows = [whole(self, z[i : i + 1], *args, return_dict=False, **kwargs)[0] for i in range(len(z))]
            import torch

            return DecoderOutput(sample=torch.cat(rows)) if return_dict else (torch.cat(rows),)

        emulated.setattr(AutoencoderKL, "decode", per_row)
    engine = continuous_engine("z-image", (1, 2, 4), sizes=((32, 32),))
    prompt = prompt_of_warm_length(engine.pipe, engine.pipe.accel.recipes["transformer"], rng, (32, 32))
    found: list[bool] = []
    decoded: list[int] = []
    checking = [False]
    real = continuous.decode_is_batch_invariant

    def check(*args: Any) -> bool:
        checking[0] = True
        try:
            found.append(real(*args) if checked == "found" else False)
        finally:
            checking[0] = False
        return found[-1]

    decode = engine.steps.decode

    def recorded(latents: Any, size: tuple[int, int]) -> Any:
        if not checking[0]:
            decoded.append(len(latents))
        return decode(latents, size)

    emulated.setattr(engine.steps, "decode", recorded)
    emulated.setattr(continuous, "decode_is_batch_invariant", check)
    engine.warm_sizes = ((32, 32),)  # as the server's start sets it: found out before any request
    run = Running(engine, 4, start=False)
    running.append(run)
    gate = Gate(run)
    run.start()
    gate.rounds(0)
    assert found == [checked == "found"] and decoded == []
    request = {
        "a": ImageRequest(prompt, 1, 32, 32, seed=1, steps=2, guidance=2.0),
        "b": ImageRequest(prompt, 1, 32, 32, seed=2, steps=4, guidance=4.0),
        "c": ImageRequest(prompt, 1, 32, 32, seed=3, steps=3, guidance=3.0),
    }
    work = {k: run.submit(r) for k, r in request.items()}
    gate.open()
    made = {k: w.future.result(60) for k, w in work.items()}
    assert all(w.bucket == 4 for w in work.values()) and gate.held[0] == [[0, 0, 0]]
    assert found == [checked == "found"]  # once for the size
    assert decoded == ([1, 1, 1] if found[0] else [4, 4, 4])
    for k, m in made.items():
        assert all(np.array_equal(a, b) for a, b in zip(pixels(m), static(engine, request[k], 4))), k


def test_a_group_decodes_at_a_smaller_bucket_only_within_the_buckets_checked(emulated: pytest.MonkeyPatch) -> None:
    """What the check found holds up to the largest bucket it decoded at: a batch of a larger one
    (the memory admission allowed more later) decodes its leavers at its own bucket."""
    engine = continuous_engine("z-image", (1, 2, 4), sizes=((32, 32),))
    worker = Running(engine, 4, start=False).worker
    worker.engine = engine
    size = (32, 32)
    worker._invariant[size] = 2
    assert [worker._decode_bucket(size, b, 1) for b in (1, 2, 4)] == [1, 1, 4]
    assert worker._decode_bucket(size, 4, 3) == 4
    worker._invariant[size] = 0
    assert [worker._decode_bucket(size, b, 1) for b in (1, 2, 4)] == [1, 2, 4]
