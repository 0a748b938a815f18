"""Request-scoped state (a per-call K/V cache) under real CUDA graphs (accel.graphs.stores, signature).

* The toy prefix model (tests/graphs/state_toy.py), its cache given (Qwen-Image 2.1's form) and
  returned (FLUX.2 klein KV's): pipeline calls with true CFG, the extract step's graph writing the
  caches and the cached steps' graphs reading them, bit-equal to eager, with allocator churn
  between calls.
* Requests of two prefix lengths interleaved in shuffled order in one pool, the longer captured
  first (the shorter's captures reuse its freed blocks, where the extract graphs' stored K/V lived).
* Qwen-Image 2.1's own blocks (diffusers' ``QwenImage21Transformer2DModel``, tiny, bf16) with its
  ``QwenImage21KVCache``, through the runner, against the stock forward.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from accel.graphs.pool import GraphPool
from accel.graphs.runner import GraphRunner
from tests.graphs.state_toy import ToyCache, ToyPrefixModel, denoise

pytestmark = pytest.mark.cuda


def _churn() -> None:
    junk = [torch.randn(n, device="cuda") for n in (1 << 18, 3 << 16, 5 << 14)]
    del junk


def _same_cache(a: ToyCache, b: ToyCache) -> bool:
    return all(
        torch.equal(getattr(x, n), getattr(y, n)) for x, y in zip(a.layers, b.layers, strict=True) for n in ("k", "v")
    )


def _churned(fn: Any) -> Any:
    """``fn``, with allocations of odd sizes before every call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        _churn()
        return fn(*args, **kwargs)

    return call


@pytest.mark.parametrize("returned", [False, True], ids=["given", "returned"])
@torch.no_grad()
def test_cfg_calls_replay_every_step_bit_equal(returned: bool) -> None:
    model = ToyPrefixModel(width=8, layers=3).cuda()
    fn = model.forward_returning if returned else model.forward
    runner = GraphRunner(fn, name="toy", pool=GraphPool("cuda"))
    runner.state_types = frozenset({ToyCache})
    with runner.capturing():
        denoise(runner, model, seed=0, returned=returned, device="cuda")
    warm = runner.stats()
    assert warm.captures == 2 and not runner.blocked, runner.blocked
    for seed in (1, 2, 3):
        want, want_caches = denoise(fn, model, seed, returned=returned, device="cuda")
        got, caches = denoise(_churned(runner), model, seed, returned=returned, device="cuda")
        assert torch.equal(got, want) and all(_same_cache(a, b) for a, b in zip(caches, want_caches, strict=True))
    st = runner.stats()
    assert st.misses == 0 and st.eager_calls == 0 and st.replays - warm.replays == 3 * 6


@torch.no_grad()
def test_requests_of_two_prefix_lengths_shuffled_in_one_pool_bit_equal() -> None:
    model = ToyPrefixModel(width=64, layers=4).cuda()
    runner = GraphRunner(model.forward, name="toy", pool=GraphPool("cuda"))
    runner.state_types = frozenset({ToyCache})
    t = torch.ones(1, device="cuda")
    with runner.capturing():
        for prefix in (96, 32):  # the longer first
            cache = ToyCache(4)
            runner(torch.randn(1, prefix + 16, 64, device="cuda"), t, kv_cache=cache, mode="extract", prefix=prefix)
            runner(torch.randn(1, 16, 64, device="cuda"), t, kv_cache=cache, mode="cached")
    g = torch.Generator("cuda").manual_seed(0)
    requests = [(p, torch.randn(1, p + 16, 64, device="cuda", generator=g)) for p in (32, 96, 32, 96, 96, 32)]
    random.Random(0).shuffle(requests)
    caches = [(ToyCache(4), ToyCache(4)) for _ in requests]
    for (prefix, x), (cache, want) in zip(requests, caches):
        _churn()
        got = runner(x, t, kv_cache=cache, mode="extract", prefix=prefix)
        assert torch.equal(got, model(x, t, kv_cache=want, mode="extract", prefix=prefix))
    for _ in range(3):
        for (_, x), (cache, want) in zip(requests, caches):
            y = x[:, -16:] * 0.5
            _churn()
            assert torch.equal(runner(y, t, kv_cache=cache, mode="cached"), model(y, t, kv_cache=want, mode="cached"))
            assert _same_cache(cache, want)
    st = runner.stats()
    assert st.captures == 4 and st.misses == 0 and st.eager_calls == 0


@pytest.mark.parametrize("cfg", [True, False], ids=["true-cfg", "no-cfg"])
@torch.no_grad()
def test_qwen_image_21_blocks_with_their_cache_bit_equal(cfg: bool) -> None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from tests.graphs import test_state_qwen21 as qwen21

    model = qwen21.tiny().to("cuda", torch.bfloat16)
    stock = lambda **call: model(**call, return_dict=False)[0]  # noqa: E731
    runner = GraphRunner(qwen21.block_loop(model), name="qwen-image-2.1 blocks", pool=GraphPool("cuda"))
    runner.state_types = frozenset({QwenImage21KVCache})
    accelerated = qwen21.Split(model, runner)
    on = dict(cfg=cfg, device="cuda", dtype=torch.bfloat16)
    with runner.capturing():
        qwen21.denoise(accelerated, 0, **on)
    warm = runner.stats()
    assert warm.captures == 2 and not runner.blocked, runner.blocked
    for seed in (1, 2, 3):
        want, want_caches = qwen21.denoise(stock, seed, **on)
        _churn()
        got, caches = qwen21.denoise(accelerated, seed, **on)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), seed
        assert qwen21.same_caches(caches, want_caches)
    st = runner.stats()
    assert st.misses == 0 and st.eager_calls == 0 and st.replays - warm.replays == 3 * 3 * (2 if cfg else 1)
