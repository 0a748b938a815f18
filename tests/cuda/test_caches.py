"""Step caches under graphs on full-size random-weight pipelines, against the same cache run eagerly.

Each cache is enabled the way its library documents; the reference is the same pipeline with the
same cache and no graphs (``mode="eager"``, which for Z-Image also gives diffusers' caches their
context), run in this process. Then the warm-up captures both paths of every signature, and
shuffled calls at two resolutions (allocator churn between them, outputs and boundary buffers
NaN-poisoned before each) must equal it bit for bit, with no call left to run eagerly. With
``compile=True`` the reference is the same compiled, cached pipeline with its graphs switched off.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from accel import accelerate_pipeline
from accel.graphs.tree import tensors
from pipelines.builders import build_pipeline

pytestmark = pytest.mark.cuda

SIZES = [(768, 512), (512, 512)]
PROMPTS = ["a red fox in fresh snow at dawn", "an isometric cutaway of a tiny underground library lit by lanterns"]
STEPS = {"z-image": 6, "qwen-image": 6}


def _call(pipe, name: str, prompt: str, wh, seed: int) -> torch.Tensor:
    guidance = dict(true_cfg_scale=4.0, negative_prompt="blurry") if name == "qwen-image" else dict(guidance_scale=0.0)
    return pipe(
        prompt=prompt,
        width=wh[0],
        height=wh[1],
        num_inference_steps=STEPS[name],
        generator=torch.Generator("cuda").manual_seed(seed),
        output_type="latent",
        **guidance,
    ).images


def _poison(pipe) -> None:
    for entry in pipe.accel.runners["transformer"].store.entries.values():
        for chain in entry.tree.chains.values():
            for t in [*tensors(chain.output), *(t for b in chain.graph.breaks for t in tensors(b.buffer))]:
                if t.is_floating_point():
                    t.fill_(float("nan"))


def _enable(pipe, name: str, cache: str) -> None:
    t = pipe.transformer
    if cache == "dbcache":
        cache_dit = pytest.importorskip("cache_dit")
        cache_dit.enable_cache(
            pipe,
            cache_config=cache_dit.DBCacheConfig(
                Fn_compute_blocks=1,
                Bn_compute_blocks=0,
                max_warmup_steps=2,
                max_continuous_cached_steps=2,
                residual_diff_threshold=100.0,  # lifted: every step its settings allow is cached
            ),
        )
        return
    from diffusers.hooks import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        TaylorSeerCacheConfig,
        apply_first_block_cache,
        apply_mag_cache,
        apply_taylorseer_cache,
    )

    ids = [r"^layers\.\d+\.attention$"] if name == "z-image" else None
    apply, config = {
        "fbc": (apply_first_block_cache, FirstBlockCacheConfig(threshold=10.0)),
        "taylorseer": (
            apply_taylorseer_cache,
            TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, cache_identifiers=ids),
        ),
        "magcache": (
            apply_mag_cache,
            MagCacheConfig(threshold=0.5, num_inference_steps=STEPS[name], mag_ratios=[1.0] * STEPS[name]),
        ),
    }[cache]
    apply(t, config)


def _disable(pipe, cache: str) -> None:
    if cache == "dbcache":
        import cache_dit

        cache_dit.disable_cache(pipe)
        return
    for m in pipe.transformer.modules():
        registry = vars(m).get("_diffusers_hook")
        if registry is not None:
            for hook in list(registry.hooks):
                registry.remove_hook(hook, recurse=False)


def _cases() -> list[tuple[str, tuple[int, int], int]]:
    cases = [(p, wh, s) for p in PROMPTS for wh in SIZES for s in (0,)]
    random.Random(0).shuffle(cases)
    return cases


def _check(pipe, name: str, cache: str, compiled: bool) -> list[str]:
    cases = _cases()
    want = {}
    if not compiled:
        accelerate_pipeline(pipe, mode="eager")
        want = {c: _call(pipe, name, *c) for c in cases}
        pipe.accel.restore()
    accelerate_pipeline(pipe, compile=compiled, text_buckets=None)
    report = pipe.accel.warmup(
        SIZES,
        prompts=PROMPTS,
        negative_prompt="blurry" if name == "qwen-image" else None,
        cfg=name == "qwen-image",
        progress=False,
    )
    print(f"\n{name} {cache} compile={compiled} warm-up:\n{report}")
    runner = pipe.accel.runners["transformer"]
    st0 = pipe.accel.stats()["transformer"]
    mismatches = []
    for i, c in enumerate(cases):
        if compiled:
            runner.enabled = False
            try:
                want[c] = _call(pipe, name, *c)
            finally:
                runner.enabled = True
        _poison(pipe)
        out = _call(pipe, name, *c)
        if not torch.equal(out, want[c]):
            mismatches.append(f"call {i} {c[1]}: max diff {(out.float() - want[c].float()).abs().max():.4f}")
        if i == 1:
            torch.cuda.empty_cache()
            junk = [torch.randn(1 << 20, device="cuda") for _ in range(16)]
            del junk
    st = pipe.accel.stats()["transformer"]
    print(pipe.accel.report())
    hook = pipe.accel.hooks["transformer"]
    assert hook.active and hook.caches.active, hook.inactive_reason
    assert st.eager_calls == st0.eager_calls, "a call ran eagerly: the warm-up missed a path"
    assert hook.caches.rules[0].counts.total_steps[1] > 0, "no step was cached"
    pipe.accel.restore()
    return mismatches


@pytest.fixture(scope="module")
def zimage():
    pipe = build_pipeline("z-image", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    del pipe
    gc.collect()  # its hooks' cycles: the next module's pipeline needs the memory
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cache", ["fbc", "taylorseer", "magcache", "dbcache"])
@torch.no_grad()
def test_z_image_cached_graphs_equal_cached_eager(zimage, cache: str) -> None:
    _enable(zimage, "z-image", cache)
    try:
        mismatches = _check(zimage, "z-image", cache, compiled=False)
    finally:
        _disable(zimage, cache)
    assert not mismatches, mismatches


@pytest.mark.parametrize("cache", ["fbc", "dbcache", "taylorseer"])
@torch.no_grad()
def test_z_image_compiled_cached_graphs_equal_compiled_cached_eager(zimage, cache: str, tmp_path) -> None:
    torch._dynamo.reset()
    _enable(zimage, "z-image", cache)
    try:
        mismatches = _check(zimage, "z-image", cache, compiled=True)
    finally:
        _disable(zimage, cache)
    assert not mismatches, mismatches


@pytest.fixture(scope="module")
def qwen():
    pipe = build_pipeline("qwen-image", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    del pipe
    gc.collect()  # its hooks' cycles: the next module's pipeline needs the memory
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cache", ["fbc", "dbcache"])
@torch.no_grad()
def test_qwen_image_cached_graphs_equal_cached_eager(qwen, cache: str) -> None:
    _enable(qwen, "qwen-image", cache)
    try:
        mismatches = _check(qwen, "qwen-image", cache, compiled=False)
    finally:
        _disable(qwen, cache)
    assert not mismatches, mismatches
