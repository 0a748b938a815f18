"""The step loop of each family (pipelines/families/<family>/steps.py) on the generic running
batch (pipelines/stepwise), eager, tiny models on the CPU, against the stock pipeline call:

* rows that all join at the first step and share steps and guidance give the call's images, bit
  for bit (text encoded and latents decoded at the call's batch size);
* rows that join at other steps, with their own steps, guidance and seeds, each give the image
  the stock call makes of that row in a call of the same batch size (the row and copies of it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pipelines.builders import build_pipeline
from pipelines.stepwise.batch import Row, RunningBatch, decode_padded, encode_padded, padded
from pipelines.stepwise.family import StepError, call_bracket, known_pipelines, steps_for
from pipelines.stepwise.schedule import Schedule

SIZE = (32, 32)
BUCKET = 4
# Prompts of one length: Qwen-Image's text encoder pads a call's prompts to the longest, so a row's
# text is the same only among prompts as long (Z-Image pads every prompt to 512 tokens).
PROMPTS = ("a tall cat", "a big dog", "a big cat", "a red owl")


# Per model: its guidance argument, a scale without guidance, and the negative prompt guidance runs with.
MODELS = {"z-image": ("guidance_scale", 0.0, None), "qwen-image": ("true_cfg_scale", 1.0, " ")}


@pytest.fixture(scope="module", params=list(MODELS))
def pipe(request: pytest.FixtureRequest) -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_pipeline(request.param)
    torch.set_num_threads(threads)


def model(pipe: Any) -> tuple[str, float, str | None]:
    return MODELS["z-image" if type(pipe).__name__.startswith("ZImage") else "qwen-image"]


def cfg(pipe: Any, guidance: float) -> bool:
    return guidance > model(pipe)[1]


def negatives(pipe: Any, guidance: float, n: int) -> list[str] | None:
    negative = model(pipe)[2]
    return [negative] * n if negative is not None and cfg(pipe, guidance) else None


def stock(pipe: Any, prompts: list[str], seeds: list[int], steps: int, guidance: float) -> torch.Tensor:
    kwarg, _, _ = model(pipe)
    extra = {"negative_prompt": negs} if (negs := negatives(pipe, guidance, len(prompts))) else {}
    return pipe(prompt=list(prompts), height=SIZE[1], width=SIZE[0], num_inference_steps=steps, **{kwarg: guidance},
                generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt", **extra).images  # fmt: skip


def row(steps: Any, text: Any, seed: int, n_steps: int, guidance: float, owner: Any = None) -> Row:
    noise = steps.noise(torch.Generator().manual_seed(seed), *SIZE)
    return Row(text, noise, Schedule(steps.scheduler(n_steps, *SIZE)), guidance, owner=owner)


def run(pipe: Any, batch: RunningBatch) -> list[Row]:
    done = []
    while batch.rows:
        with call_bracket(pipe):
            done += batch.step()[1]
    return done


@pytest.mark.parametrize("guided", [False, True])
def test_rows_that_join_together_give_the_stock_call_bit_for_bit(pipe: Any, guided: bool) -> None:
    steps = steps_for(pipe)
    guidance = 3.0 if guided else model(pipe)[1]
    seeds = [random.randrange(10**6) for _ in PROMPTS]
    reference = stock(pipe, list(PROMPTS), seeds, 3, guidance)
    on = cfg(pipe, guidance)
    texts = encode_padded(steps, PROMPTS, negatives(pipe, guidance, len(PROMPTS)), on, BUCKET)
    batch = RunningBatch(steps, BUCKET, SIZE, on)
    rows = [row(steps, t, s, 3, guidance) for t, s in zip(texts, seeds)]
    for r in rows:
        batch.add(r)
    assert run(pipe, batch) == rows and batch.free == BUCKET
    images = decode_padded(steps, [r.latents for r in rows], SIZE, BUCKET)
    assert torch.equal(images, reference), f"seeds {seeds}: {(images - reference).abs().max()}"


def test_rows_at_their_own_steps_each_give_their_own_stock_call(pipe: Any) -> None:
    steps = steps_for(pipe)
    schedule_seed = random.randrange(2**32)
    rng = random.Random(schedule_seed)
    asked = [(p, rng.randrange(10**6), rng.choice((2, 3, 5)), rng.choice((1.5, 3.0, 6.0))) for p in PROMPTS * 2]
    batch = RunningBatch(steps, BUCKET, SIZE, True)
    waiting, done, joined_under_way, stepped = list(asked), [], 0, 0
    while waiting or batch.rows:
        # The second row always joins right after the first step, so at least one row joins a
        # batch under way whatever the draw; the rest join at random.
        second = len(waiting) == len(asked) - 1 and stepped == 1
        if waiting and batch.free and (not batch.rows or second or (stepped and rng.random() < 0.6)):
            prompt, seed, n, g = waiting.pop(0)
            joined_under_way += any(r.schedule.index for r in batch.rows)
            (text,) = encode_padded(steps, [prompt], negatives(pipe, g, 1), True, BUCKET)
            batch.add(row(steps, text, seed, n, g, owner=(prompt, seed, n, g)))
        elif batch.rows:
            with call_bracket(pipe):
                done += batch.step()[1]
            stepped += 1
    assert joined_under_way, f"schedule seed {schedule_seed}"
    assert sorted(r.owner for r in done) == sorted(asked), f"schedule seed {schedule_seed}"
    for r in done:
        prompt, seed, n, g = r.owner
        image = decode_padded(steps, [r.latents], SIZE, BUCKET)
        reference = stock(pipe, [prompt] * BUCKET, [seed] * BUCKET, n, g)[:1]
        assert torch.equal(image, reference), (
            f"{r.owner}, schedule seed {schedule_seed}: {(image - reference).abs().max()}"
        )


def test_a_pipeline_without_a_step_loop_is_refused_in_one_line() -> None:
    assert "ZImagePipeline" in known_pipelines()
    with pytest.raises(StepError, match="FluxPipeline's loop is not run a step at a time"):
        steps_for(build_pipeline("flux.1"))
    with pytest.raises(ValueError):
        padded([], 2)
    assert padded([1, 2], 4) == [1, 2, 2, 2]
