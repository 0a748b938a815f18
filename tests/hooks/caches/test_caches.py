"""Step caches under graphs, on tiny pipelines and emulated CUDA graphs (tests/helpers/emulator.py).

Every cache is enabled the way its library documents and compared, call by call and bit for bit,
with the same pipeline and the same cache run eagerly (``mode="eager"``: no graphs; for Z-Image,
which has no ``CacheMixin``, that is also where its caches get their context). Random weights
rarely trip a real threshold, so configurations force known patterns (a threshold that caches
every step it may, TaylorSeer's interval, MagCache with flat ratios) beside the documented ones.
"""

from __future__ import annotations

import contextlib
import logging
import random

import pytest
import torch
from diffusers.hooks import (
    FirstBlockCacheConfig,
    HookRegistry,
    MagCacheConfig,
    ModelHook,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
    apply_mag_cache,
    apply_pyramid_attention_broadcast,
    apply_taylorseer_cache,
)

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines

STEPS = 6
SIZES = [(96, 64), (64, 96)]


def _call(pipe, name: str, seed: int = 0, wh=(96, 64), prompt: str = "a fox in the snow", steps: int = STEPS):
    guidance = dict(true_cfg_scale=4.0) if name == "qwen-image" else dict(guidance_scale=4.0)
    return pipe(
        prompt=prompt,
        negative_prompt="blurry",
        width=wh[0],
        height=wh[1],
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        **guidance,
    ).images


def _taylorseer(name: str, **kw) -> TaylorSeerCacheConfig:
    # diffusers' default patterns name Qwen-Image's attention modules, not Z-Image's.
    ids = [r"^layers\.\d+\.attention$"] if name == "z-image" else None
    return TaylorSeerCacheConfig(cache_identifiers=ids, **kw)


CACHES = {
    "fbc-forced": lambda name: (apply_first_block_cache, FirstBlockCacheConfig(threshold=10.0)),
    "fbc-documented": lambda name: (apply_first_block_cache, FirstBlockCacheConfig(threshold=0.2)),
    "taylorseer": lambda name: (
        apply_taylorseer_cache,
        _taylorseer(name, cache_interval=3, disable_cache_before_step=2),
    ),
    "magcache": lambda name: (
        apply_mag_cache,
        MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS, retention_ratio=0.2),
    ),
}


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    emulate_pipelines(monkeypatch)
    return monkeypatch


def _cached(name: str, cache: str):
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    apply, config = CACHES[cache](name)
    apply(pipe.transformer, config)
    return pipe


def _cases(name: str) -> list[tuple[int, tuple[int, int], str]]:
    cases = [(s, wh, p) for s in (0, 1) for wh in SIZES for p in ("a fox in the snow", "a lighthouse at night")]
    random.Random(hash(name) % 97).shuffle(cases)
    return cases[:5]


def _eager_reference(pipe, name: str, cases) -> list[torch.Tensor]:
    accelerate_pipeline(pipe, mode="eager")
    try:
        return [_call(pipe, name, s, wh, p) for s, wh, p in cases]
    finally:
        pipe.accel.restore()


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_cached_graphs_equal_the_cached_pipeline_run_eagerly(name: str, cache: str, emulated) -> None:
    pipe = _cached(name, cache)
    cases = _cases(name)
    want = _eager_reference(pipe, name, cases)
    accelerate_pipeline(pipe, capture_on_miss=True)
    got = [_call(pipe, name, s, wh, p) for s, wh, p in cases]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i} {cases[i]}: max diff {(a - b).abs().max()}"
    hook = pipe.accel.hooks["transformer"]
    assert hook.active and hook.caches.active, hook.inactive_reason
    st = pipe.accel.stats()["transformer"]
    assert st.replays > 0 and st.eager_calls == 0
    counts = hook.caches.rules[0].counts
    if cache != "fbc-documented":  # the forced patterns cache some steps, and capture both paths
        assert counts.total_steps[1] > 0 and st.path_captures > 0
        assert all(len(paths) >= 2 for paths in st.paths_per_entry)
    assert "step cache, last call" in pipe.accel.report()


def test_warmup_captures_the_cached_path_too(emulated) -> None:
    name = "qwen-image"
    pipe = _cached(name, "fbc-documented")  # its threshold never trips on random weights
    want = _eager_reference(pipe, name, [(0, (96, 64), "a fox in the snow")])
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(96, 64)], prompts=["a fox in the snow"], negative_prompt="blurry", progress=False)
    st = pipe.accel.stats()["transformer"]
    assert all(sorted(p) == ["False", "True"] for p in st.paths_per_entry), st.paths_per_entry
    assert torch.equal(_call(pipe, name), want[0])
    after = pipe.accel.stats()["transformer"]
    assert after.misses == 0 and after.eager_calls == 0 and after.captures == st.captures


@pytest.mark.parametrize("change", ["state", "weights"])
def test_graphs_captured_again_after_a_change_take_every_path_again(change: str, emulated) -> None:
    """A change the guard sees drops the graphs; the next call captures them again, on its way.
    The cached steps' path too, when the call takes it, as the warm-up did: not eagerly until
    the next warm-up (the H200 run of bench_caches: 18 of 40 calls eager after a change)."""
    name = "qwen-image"
    pipe = _cached(name, "fbc-forced")  # caches every step after the first
    cases = [(0, (96, 64), "a fox in the snow"), (1, (96, 64), "a fox in the snow")]  # the warmed-up signature
    block = pipe.transformer.transformer_blocks[0]
    with torch.no_grad():
        weight = block.attn.to_q.weight
        original = weight.clone()
        weight.mul_(1.01)
        want_changed = _eager_reference(pipe, name, cases)
        weight.copy_(original)
    want = _eager_reference(pipe, name, cases)
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(96, 64)], prompts=["a fox in the snow"], negative_prompt="blurry", progress=False)
    assert torch.equal(_call(pipe, name, *cases[0]), want[0])
    before = pipe.accel.stats()["transformer"]
    assert before.eager_calls == 0 and before.path_captures > 0
    if change == "state":
        block.some_setting = 2  # a plain attribute the forward might read: the graphs are of another state
    else:
        with torch.no_grad():
            weight.mul_(1.01)
        want = want_changed
    got = [_call(pipe, name, *c) for c in cases]
    after = pipe.accel.stats()["transformer"]
    assert after.captures > before.captures and after.path_captures > before.path_captures
    assert after.eager_calls == 0 and after.misses == 0, (after.eager_calls, after.misses)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"


def test_cache_enabled_after_accelerate_pipeline_drops_and_recaptures(emulated) -> None:
    name = "qwen-image"
    plain = build_pipeline(name, "tiny")
    plain.set_progress_bar_config(disable=True)
    accelerate_pipeline(plain, capture_on_miss=True)
    before = _call(plain, name)
    st0 = plain.accel.stats()["transformer"]
    apply, config = CACHES["fbc-forced"](name)
    apply(plain.transformer, config)
    after = _call(plain, name)
    st = plain.accel.stats()["transformer"]
    assert st.captures > st0.captures  # the graphs without the cache were not replayed
    plain.accel.restore()
    ref = _cached(name, "fbc-forced")
    assert torch.equal(after, _eager_reference(ref, name, [(0, (96, 64), "a fox in the snow")])[0])
    assert not torch.equal(after, before)  # the cache is really on


def test_restore_leaves_the_cache_as_the_user_set_it(emulated) -> None:
    name = "qwen-image"
    pipe = _cached(name, "taylorseer")
    stock = _call(pipe, name)
    head_hooks = [m._diffusers_hook for m in pipe.transformer.modules() if hasattr(m, "_diffusers_hook")]
    accelerate_pipeline(pipe, capture_on_miss=True)
    _call(pipe, name)
    pipe.accel.restore()
    assert [type(h).__name__ for r in head_hooks for h in r.hooks.values()].count("TaylorSeerCacheHook") > 0
    assert all("_measure_should_compute" not in vars(h) for r in head_hooks for h in r.hooks.values())
    assert torch.equal(_call(pipe, name), stock)


def test_taylorseer_under_graphs_is_not_frozen_into_nan(emulated) -> None:
    """The regression: graphs captured TaylorSeer's decision and state once; every replay was NaN."""
    name = "qwen-image"
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2))
    want = _eager_reference(pipe, name, [(0, (96, 64), "a fox in the snow")])[0]
    accelerate_pipeline(pipe, capture_on_miss=True)
    got = _call(pipe, name, steps=12)
    assert torch.isfinite(got).all()
    assert torch.equal(_call(pipe, name), want)


class CountingHook(ModelHook):
    """A hook the library has no rule for: it keeps host state a graph would freeze."""

    _is_stateful = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs

    def reset_state(self, module):
        return module


def test_a_hook_without_a_rule_switches_graphs_off_by_name(emulated, caplog) -> None:
    name = "qwen-image"
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe, capture_on_miss=True)
    want = _call(pipe, name)
    block = pipe.transformer.transformer_blocks[0]
    hook = CountingHook()
    HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "user_counter")
    with caplog.at_level(logging.WARNING):
        got = [_call(pipe, name) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "CountingHook" in r.getMessage()]
    assert len(said) == 1 and "'user_counter'" in said[0] and "transformer_blocks.0" in said[0]
    assert all(torch.equal(g, want) for g in got)
    assert hook.calls == 2 * 2 * STEPS  # ran at every call of both branches: nothing was frozen
    h = pipe.accel.hooks["transformer"]
    assert not h.active and "CountingHook" in h.inactive_reason
    block._diffusers_hook.remove_hook("user_counter")
    _call(pipe, name)
    assert h.active and pipe.accel.stats()["transformer"].replays > 0


def test_unsupported_diffusers_cache_and_two_caches_are_refused(emulated, caplog) -> None:
    name = "qwen-image"
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    apply_pyramid_attention_broadcast(
        pipe.transformer, PyramidAttentionBroadcastConfig(current_timestep_callback=lambda: pipe.current_timestep)
    )
    accelerate_pipeline(pipe, capture_on_miss=True)
    # Stock PAB itself fails on Qwen-Image's two guidance branches (their text lengths differ);
    # the refusal comes first, where the call starts.
    with caplog.at_level(logging.WARNING), contextlib.suppress(RuntimeError):
        _call(pipe, name)
    assert any("PyramidAttentionBroadcastHook" in r.getMessage() for r in caplog.records)
    assert not pipe.accel.hooks["transformer"].active

    two = _cached(name, "fbc-forced")
    apply_taylorseer_cache(two.transformer, TaylorSeerCacheConfig())
    accelerate_pipeline(two, capture_on_miss=True)
    with caplog.at_level(logging.WARNING):
        _call(two, name)
    assert any("2 step caches at once" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_cache_dit_dbcache_under_graphs_keeps_its_decisions(name: str, order: str, emulated) -> None:
    cache_dit = pytest.importorskip("cache_dit")
    config = cache_dit.DBCacheConfig(
        residual_diff_threshold=100.0,  # lifted: caches every step its settings allow
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=2,
        max_continuous_cached_steps=2,
    )
    ref = build_pipeline(name, "tiny")
    ref.set_progress_bar_config(disable=True)
    cache_dit.enable_cache(ref, cache_config=config)
    cases = _cases(name)[:3]
    want = [_call(ref, name, s, wh, p, steps=8) for s, wh, p in cases]

    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    if order == "before":
        cache_dit.enable_cache(pipe, cache_config=config)
        accelerate_pipeline(pipe, capture_on_miss=True)
    else:
        accelerate_pipeline(pipe, capture_on_miss=True)
        cache_dit.enable_cache(pipe, cache_config=config)
    got = [_call(pipe, name, s, wh, p, steps=8) for s, wh, p in cases]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
    hook = pipe.accel.hooks["transformer"]
    assert hook.active and hook.caches.active
    st = pipe.accel.stats()["transformer"]
    assert st.eager_calls == 0 and st.path_captures > 0
    assert hook.caches.rules[0].counts.total_steps[1] > 0  # steps were cached under graphs
    pipe.accel.restore()
    # cache-dit is left as it was: the pipeline still caches, and equals the eager cached run
    assert torch.equal(_call(pipe, name, *cases[0], steps=8), want[0])
