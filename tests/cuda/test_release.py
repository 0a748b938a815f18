"""Dropped accelerated pipelines give their GPU memory back, with or without ``restore()``:
after each scenario the pipeline's models are collected, and a second run of it leaves the
allocator where the first left it. A leak here is a whole pipeline's memory per pipeline built,
which a process that builds several (a server, a test suite) runs out of. cache-dit's own
adapter keeps a pipeline it was enabled on until ``disable_cache``: dbcache is run restored only."""

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


@pytest.mark.parametrize(
    "model,cache,compile,restore",
    [
        ("z-image", None, False, False),
        ("z-image", None, False, True),
        ("z-image", "fbc", False, False),
        ("qwen-image", None, False, False),
        ("qwen-image", "dbcache", False, True),
        ("z-image", None, True, False),
    ],
)
@torch.no_grad()
def test_a_dropped_pipeline_gives_its_memory_back(model: str, cache: str | None, compile: bool, restore: bool) -> None:
    allocated = []
    for _ in range(2):
        if compile:
            torch._dynamo.reset()
        ref = _scenario(model, cache, compile, restore)
        if compile:
            torch._dynamo.reset()  # compiled code holds its own references until reset
        gc.collect()
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per stream it ran on (each pipeline's capture stream): the
        # process's, not the pipeline's, and given back here so only a leak remains.
        torch._C._cuda_clearCublasWorkspaces()
        if ref() is not None:
            pytest.fail(f"the dropped pipeline's {type(ref()).__name__} is still alive:\n  {holder_path(ref())}")
        allocated.append(torch.cuda.memory_allocated())
    grown = allocated[1] - allocated[0]
    # A tiny pipeline holds tens of MiB; a leak of it shows. Qwen-Image's second run measured
    # 1.0 MiB above its first on an H200 (its models collected): not traced to this library yet.
    assert grown <= 2 << 20, f"{grown / 2**20:.1f} MiB more allocated after a second pipeline was dropped"


@torch.no_grad()
def test_a_restored_pipeline_is_freed_at_del_without_the_collector() -> None:
    """``pipe.accel.restore(); del pipe`` frees the models by reference counting, as a stock
    Z-Image pipeline is freed at ``del``: ``torch.cuda.empty_cache()`` right after gives the
    memory back without a ``gc.collect()``."""
    gc.collect()
    gc.disable()
    try:
        ref = _scenario("z-image", None, False, True)
        alive = ref()
    finally:
        gc.enable()
    assert alive is None, f"a restored pipeline outlives del until the collector runs:\n  {holder_path(alive)}"
