"""Decisions under real CUDA graphs: the toy step cache of tests/graphs/test_branches.py on the GPU.

Two input shapes share one pool, replayed in shuffled order with allocator churn between calls;
every output buffer and boundary buffer is NaN-poisoned before each call, so a replay that skips a
write shows. Each call equals the same cache run eagerly on a twin, bit for bit.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from accel import GraphRunner
from accel.graphs.tree import tensors
from tests.helpers.toy_cache import ToyCache, toy_forward

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _poison(runner: GraphRunner) -> None:
    for entry in runner.store.entries.values():
        for chain in entry.tree.chains.values():
            for t in [*tensors(chain.output), *(t for b in chain.graph.breaks for t in tensors(b.buffer))]:
                if t.is_floating_point():
                    t.fill_(float("nan"))


def _steps(n: int, seed: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(*shape, device=DEV, generator=g)
    out = []
    for i in range(n):
        scale = 1.0 if i % 3 == 0 else 0.001
        x = x + scale * torch.randn(*shape, device=DEV, generator=g)
        out.append(x)
    return out


class Caches:
    """One cache per shape (a cache keeps per-resolution state), as one StepState."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        self.by_shape = {s: ToyCache(0.05) for s in shapes}

    def snapshot(self) -> Any:
        return {s: c.snapshot() for s, c in self.by_shape.items()}

    def restore(self, snap: Any) -> None:
        for s, c in self.by_shape.items():
            c.restore(snap[s])


@torch.no_grad()
def test_decisions_replay_their_own_chains_bit_for_bit() -> None:
    g = torch.Generator(DEV).manual_seed(1)
    w = (torch.randn(64, 64, device=DEV, generator=g) / 8, torch.randn(64, 64, device=DEV, generator=g) / 8)
    shapes = [(128, 64), (32, 64)]
    inputs = {s: _steps(9, i, s) for i, s in enumerate(shapes)}
    order = [(s, i) for s in shapes for i in range(9)]
    random.Random(0).shuffle(order)
    order.sort(key=lambda c: c[1])  # each shape's steps in order, the shapes interleaved
    caches, twins = Caches(shapes), Caches(shapes)
    fn = toy_forward(w)
    runner = GraphRunner(fn, name="toy", capture_on_miss=True)
    runner.state = caches
    for n, (s, i) in enumerate(order):
        _poison(runner)
        got = runner(inputs[s][i], caches.by_shape[s])
        want = fn(inputs[s][i], twins.by_shape[s])
        assert torch.equal(got, want), f"call {n}: shape {s} step {i}"
        if n % 4 == 3:  # allocator churn between replays
            junk = [torch.randn(1 << 18, device=DEV) for _ in range(8)]
            del junk
            torch.cuda.empty_cache()
    for s in shapes:
        c, t = caches.by_shape[s], twins.by_shape[s]
        assert (c.calls, c.computed) == (t.calls, t.computed) and 0 < c.computed < c.calls
    st = runner.stats()
    assert st.entries == 2 and all(sorted(p) == ["False", "True"] for p in st.paths_per_entry)
    assert st.eager_calls == 0 and st.path_switches > 0
