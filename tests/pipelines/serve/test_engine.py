"""The engine and the device worker with a fake pipeline: what one pipeline call receives for a
batch (a fresh prompt list, one generator per image with its own seed, negatives and guidance
as the model takes them), which requests get which images, and a failed call failing its own
batch only while the worker goes on."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from pipelines.generation import ModelSettings, PreparedPipeline, RunError, call_settings
from pipelines.serve.batcher import Batcher, Work
from pipelines.serve.engine import Engine, Plan
from pipelines.serve.errors import ServeError
from pipelines.serve.metrics import Metrics
from pipelines.serve.schema import ImageRequest
from pipelines.serve.worker import BatchFailed, DeviceWorker, RequestGone
from tests.pipelines.serve.server import decode


@dataclasses.dataclass
class Output:
    images: np.ndarray


class FakePipeline:
    """Takes the arguments a diffusers text-to-image call takes; each image is noise drawn from
    its own generator, so an image depends on its seed alone. Edits the prompt list it is given,
    as ZImagePipeline does (it applies its chat template in place)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_on: str | None = None
        self.nan = False

    def __call__(self, prompt: list[str], height: int, width: int, num_inference_steps: int = 30,
                 guidance_scale: float = 5.0, negative_prompt: list[str] | None = None,
                 num_images_per_prompt: int = 1, generator: list[torch.Generator] | None = None,
                 output_type: str = "pil") -> Output:  # fmt: skip
        self.calls.append(dict(prompt=list(prompt), height=height, width=width, steps=num_inference_steps,
                               guidance=guidance_scale, negative=negative_prompt, generator=generator))  # fmt: skip
        if self.fail_on is not None and any(self.fail_on in p for p in prompt):
            raise RuntimeError(f"the model failed on\n{self.fail_on!r}")
        images = np.stack([torch.rand(height, width, 3, generator=g).numpy() for g in generator or []])
        for i in range(len(prompt)):
            prompt[i] = f"<template>{prompt[i]}"
        if self.nan:
            images[0, 0, 0, 0] = np.nan
        return Output(images)


def engine(pipe: FakePipeline) -> Engine:
    call = call_settings(pipe, "fake", "tiny")  # the CLI's defaults for a pipeline without a recipe
    settings = ModelSettings(model="fake", mode_flag="eager")
    return Engine(PreparedPipeline(pipe, settings, torch.device("cpu"), torch.float32, call))


def request(prompt: str, n: int = 1, seed: int | None = 0, **kw: Any) -> ImageRequest:
    return ImageRequest(prompt, n, 16, 8, seed=seed, **kw)


def pixels(e: Engine, plans: list[Plan]) -> list[list[bytes]]:
    return [[decode(g.b64_json).tobytes() for g in images] for images in e.run(plans)]


def test_a_batch_is_one_call_with_a_generator_per_image_and_each_image_its_own() -> None:
    pipe = FakePipeline()
    e = engine(pipe)
    plans = [e.plan(request("a", n=2, seed=10)), e.plan(request("b", seed=3)), e.plan(request("c", n=1, seed=10))]
    together = pixels(e, plans)
    call = pipe.calls[-1]
    assert call["prompt"] == ["a", "a", "b", "c"]  # the list the engine built, before the pipeline edited it
    assert [g.initial_seed() for g in call["generator"]] == [10, 11, 3, 10]
    assert (call["width"], call["height"]) == (16, 8)
    alone = [pixels(e, [p])[0] for p in plans]
    assert together == alone  # every image is its seed's, whatever shares its call
    assert together[0][0] == together[2][0]  # same seed, same noise
    assert together[0][0] != together[0][1]


def test_plans_take_the_models_defaults_and_a_negative_prompt_only_where_guidance_runs() -> None:
    e = engine(FakePipeline())  # no recipe: guidance_scale, CFG above 1, no default steps but 30
    p = e.plan(request("a", seed=None, n=3))
    assert (p.call.steps, p.call.guidance, p.call.negative_prompt) == (30, None, None)
    assert len(p.seeds) == 3 and p.seeds == tuple(range(p.seeds[0], p.seeds[0] + 3))
    assert e.plan(request("a", negative_prompt="blur", guidance=1.0)).call.negative_prompt is None  # no CFG at 1
    strong = e.plan(request("a", negative_prompt="blur", guidance=4.0))
    assert strong.call.negative_prompt == "blur"
    assert strong.key != e.plan(request("a", guidance=4.0)).key  # with and without negatives never share a call
    assert e.plan(request("a", lora="style")).key != e.plan(request("a")).key  # nor two adapter states
    e.run([strong])
    assert e.pipe.calls[-1]["negative"] == ["blur"]
    assert e.pipe.calls[-1]["guidance"] == 4.0


def test_what_a_request_gives_and_the_model_drops_is_in_its_call_not_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A negative prompt without CFG is dropped from the call and noted on its settings; the
    server logs nothing for it (a request's image record says what ran)."""
    e = engine(FakePipeline())
    with caplog.at_level(logging.DEBUG):
        plan = e.plan(request("a", negative_prompt="blur", guidance=1.0))
    assert plan.call.negative_prompt is None
    assert plan.call.notes == ("--negative-prompt is ignored: classifier-free guidance runs only with --guidance "
                               "above 1 (this run uses 1)",)  # fmt: skip
    assert caplog.records == []


def test_non_finite_pixels_are_an_error_not_an_image() -> None:
    pipe = FakePipeline()
    pipe.nan = True
    with pytest.raises(RunError, match="NaN or infinite pixels for 16x8 seed 0"):
        engine(pipe).run([engine(pipe).plan(request("a"))])


def test_steps_the_scheduler_refuses_are_a_400() -> None:
    class WithScheduler(FakePipeline):
        scheduler = type("S", (), {"config": {"num_train_timesteps": 10}})()

    e = engine(WithScheduler())
    with pytest.raises(ServeError) as err:
        e.plan(request("a", steps=11))
    assert (err.value.status, err.value.param) == (400, "steps")


def test_a_failed_call_fails_its_batch_only_and_the_worker_goes_on() -> None:
    pipe = FakePipeline()
    pipe.fail_on = "boom"
    e = engine(pipe)
    batcher = Batcher(max_queue=16, max_batch=2, max_wait=0.0)
    metrics = Metrics(2, lambda: batcher.depth)
    fatal: list[BaseException] = []
    worker = DeviceWorker(batcher, metrics, lambda: e, lambda engine: None, fatal.append)
    works = [Work(p.key, p.request.n, p) for p in (e.plan(request("boom")), e.plan(request("x")),
                                                   e.plan(request("y", n=2)))]  # fmt: skip
    for w in works:
        batcher.submit(w)
    worker.start()
    with pytest.raises(BatchFailed, match=r"generation failed: RuntimeError: the model failed on 'boom'") as failed:
        works[0].future.result(30)
    assert "\n" not in str(failed.value)
    assert str(works[1].future.exception(30)) == str(failed.value)  # the request that shared its call failed too
    assert len(works[2].future.result(30)) == 2  # the next batch was served
    batcher.close()
    worker.join(10)
    assert not worker.is_alive() and not fatal
    samples = {s.name + str(s.labels): s.value for fam in metrics.registry.collect() for s in fam.samples}
    assert samples["bcg_serve_pipeline_calls_total{'ran': 'failed'}"] == 1
    assert samples["bcg_serve_pipeline_calls_total{'ran': 'eager'}"] == 1
    assert samples["bcg_serve_images_total{}"] == 2


class SteppingPipeline(FakePipeline):
    """A fake whose call runs its steps, each ending in ``callback_on_step_end`` as diffusers' do;
    the steps of every call are counted, and ``maybe_free_model_hooks`` (a pipeline's end) too."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_run: list[int] = []
        self.freed = 0
        self.started = threading.Event()

    def __call__(self, prompt: list[str], height: int, width: int, num_inference_steps: int = 30,
                 num_images_per_prompt: int = 1, generator: list[torch.Generator] | None = None,
                 output_type: str = "pil", callback_on_step_end: Any = None) -> Output:  # fmt: skip
        self.steps_run.append(0)
        self.started.set()
        for i in range(num_inference_steps):
            time.sleep(0.002)
            self.steps_run[-1] += 1
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, i, {})
        self.maybe_free_model_hooks()
        return super().__call__(prompt, height, width, num_inference_steps, generator=generator,
                                num_images_per_prompt=num_images_per_prompt, output_type=output_type)  # fmt: skip

    def maybe_free_model_hooks(self) -> None:
        self.freed += 1


def test_a_call_whose_requests_all_gave_up_stops_at_a_step_boundary_and_the_next_is_served() -> None:
    pipe = SteppingPipeline()
    e = engine(pipe)
    batcher = Batcher(max_queue=16, max_batch=1, max_wait=0.0)
    metrics = Metrics(1, lambda: batcher.depth)
    worker = DeviceWorker(batcher, metrics, lambda: e, lambda engine: None, lambda error: None)
    long, short = (Work(p.key, 1, p) for p in (e.plan(request("long", steps=1000)), e.plan(request("short", steps=2))))
    batcher.submit(long)
    worker.start()
    assert pipe.started.wait(30)
    assert worker.call_started is not None  # /ready reads how long the call has run
    batcher.submit(short)
    long.gone = True  # its request timed out: the service marks it so
    assert len(short.future.result(30)) == 1  # served, once the long call stopped
    with pytest.raises(RequestGone):
        long.future.result(0)
    assert pipe.steps_run[0] < 1000 and pipe.steps_run[1] == 2  # stopped at a step's end; the next one whole
    assert pipe.freed == 2  # the stopped call's end ran too (its step caches reset, the call's lock let go)
    batcher.close()
    worker.join(10)
    samples = {s.name + str(s.labels): s.value for fam in metrics.registry.collect() for s in fam.samples}
    assert samples["bcg_serve_pipeline_calls_total{'ran': 'stopped'}"] == 1
    assert samples["bcg_serve_images_total{}"] == 1
    assert worker.call_started is None


def test_a_start_that_fails_is_reported_and_serves_nothing() -> None:
    batcher = Batcher(max_queue=4, max_batch=1, max_wait=0.0)
    fatal: list[BaseException] = []

    def start() -> Engine:
        raise OSError("no such model")

    worker = DeviceWorker(batcher, Metrics(1, lambda: 0), start, lambda engine: None, fatal.append)
    worker.start()
    worker.join(10)
    assert [str(e) for e in fatal] == ["no such model"]
    assert batcher.depth == 0 and not batcher.closed
