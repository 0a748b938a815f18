"""Dropped accelerated pipelines give their GPU memory back, with or without ``restore()``:
after each scenario the pipeline's models are collected and the allocator holds what it held
before (graph pools included). A leak here is a whole pipeline's memory per pipeline built, which
a process that builds several (a server, a test suite) runs out of."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.cuda import test_caches as caches
from tests.helpers.leaks import holder_path

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _scenario(model: str, cache: str | None, compile: bool, restore: bool) -> weakref.ref:
    pipe = build_pipeline(model, "tiny", device=DEV, seed=0)
    pipe.set_progress_bar_config(disable=True)
    ref = weakref.ref(pipe.transformer)
    if cache:
        caches._enable(pipe, model, cache)
    accelerate_pipeline(pipe, compile=compile, text_buckets=None)
    cfg = model == "qwen-image"
    guidance = dict(true_cfg_scale=4.0, negative_prompt="blurry") if cfg else {}
    pipe.accel.warmup(
        [(128, 128)], prompts=["a fox"], negative_prompt="blurry" if cfg else None, cfg=cfg, progress=False
    )
    pipe(prompt="a fox", width=128, height=128, num_inference_steps=4, output_type="latent", **guidance)
    if restore:
        pipe.accel.restore()
        if cache:
            caches._disable(pipe, cache)
    return ref


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "dropped"])
@pytest.mark.parametrize(
    "model,cache,compile",
    [("z-image", None, False), ("z-image", "fbc", False), ("qwen-image", "dbcache", False), ("z-image", None, True)],
)
@torch.no_grad()
def test_a_dropped_pipeline_gives_its_memory_back(model: str, cache: str | None, compile: bool, restore: bool) -> None:
    if compile:
        torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ref = _scenario(model, cache, compile, restore)
    gc.collect()
    torch.cuda.synchronize()
    if ref() is not None:
        pytest.fail(f"the dropped pipeline's {type(ref()).__name__} is still alive:\n  {holder_path(ref())}")
    if compile:
        torch._dynamo.reset()  # compiled code holds its own constants until reset
        gc.collect()
    leaked = torch.cuda.memory_allocated() - before
    assert leaked <= 1 << 20, f"{leaked / 2**20:.1f} MiB still allocated after the pipeline was dropped"
