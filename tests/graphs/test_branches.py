"""Decisions under graphs: a captured call as a tree of chains, on emulated CUDA graphs.

A toy step cache decides after its first "block" whether to compute the rest or reuse last
step's residual (a FirstBlockCache in miniature): its decision is an eager break, its state lives
in fixed slots that the graphs read and write. Every accelerated run is compared, step by step and
bit for bit, with a twin of the same cache run eagerly on the same inputs.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from accel.graphs import bcg, marks
from accel.graphs.bcg import BreakError, eager_on_graph
from accel.graphs.branches import Chain, GraphTree
from accel.graphs.runner import GraphRunner
from tests.helpers.emulator import emulate_cuda, segment_replays
from tests.helpers.toy_cache import ToyCache, toy_forward


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_cuda(monkeypatch)


def _steps(n: int, seed: int = 0, shape: tuple[int, int] = (3, 8)) -> list[torch.Tensor]:
    """Inputs whose first-block residual changes by a lot, then a little, then a lot again."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape, generator=g)
    scales = [1.0, 0.001, 0.002, 1.0, 0.001, 1.0, 0.001, 0.001, 1.0, 0.002][:n]
    out, x = [], base
    for s in scales:
        x = x + s * torch.randn(*shape, generator=g)
        out.append(x)
    return out


def _weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g) / 3, torch.randn(8, 8, generator=g) / 3


def _eager(xs: list[torch.Tensor], threshold: float) -> tuple[list[torch.Tensor], ToyCache]:
    cache = ToyCache(threshold)
    fn = toy_forward(_weights())
    return [fn(x, cache) for x in xs], cache


def test_eager_twin_takes_both_paths() -> None:
    _, cache = _eager(_steps(10), 0.05)
    assert 0 < cache.computed < cache.calls == 10  # the inputs exercise both decisions


def test_graphs_follow_each_decision_and_equal_eager(emulated: None) -> None:
    xs = _steps(10)
    want, twin = _eager(xs, 0.05)
    cache = ToyCache(0.05)
    runner = GraphRunner(toy_forward(_weights()), name="toy", capture_on_miss=True)
    runner.state = cache
    got = [runner(x, cache) for x in xs]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}"
    # each decision ran once per call, as eagerly, however often the call was captured
    assert (cache.calls, cache.computed) == (twin.calls, twin.computed)
    st = runner.stats()
    assert st.entries == 1 and sorted(st.paths_per_entry[0]) == ["False", "True"]
    assert st.captures == 2 and st.path_captures == 1 and st.path_misses == 1
    assert st.eager_calls == 0 and st.replays == 10
    assert st.path_switches > 0  # later calls moved between the two chains at the decision


def test_a_path_without_graph_runs_eagerly_and_its_decision_once(emulated: None, caplog) -> None:
    xs = _steps(10)
    want, twin = _eager(xs, 0.05)
    cache = ToyCache(0.05)
    runner = GraphRunner(toy_forward(_weights()), name="toy")
    runner.state = cache
    with runner.capturing():
        first = runner(xs[0], cache)  # captures the compute path only
    with caplog.at_level(logging.INFO, logger="accel.graphs.runner"):
        got = [first] + [runner(x, cache) for x in xs[1:]]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}"
    assert (cache.calls, cache.computed) == (twin.calls, twin.computed)
    st = runner.stats()
    assert st.paths_per_entry == [["True"]] and st.path_misses == twin.calls - twin.computed
    assert st.eager_calls == st.path_misses
    said = [r.getMessage() for r in caplog.records if "decision path False" in r.getMessage()]
    assert len(said) == 1, said  # said once, not per step


def test_replay_never_runs_the_other_paths_segments(emulated: None) -> None:
    xs = _steps(10)
    cache = ToyCache(0.05)
    runner = GraphRunner(toy_forward(_weights()), name="toy", capture_on_miss=True)
    runner.state = cache
    for x in xs[:3]:
        runner(x, cache)  # both paths captured by now (compute, cache, cache)
    entry = next(iter(runner.store.entries.values()))
    chains = entry.tree.chains
    cached_tail = chains[(False,)].graph.segments[-1]
    computed_tail = chains[(True,)].graph.segments[-1]
    before = cached_tail.replays, computed_tail.replays
    runner(xs[3], cache)  # a big change: computes
    assert computed_tail.replays == before[1] + 1 and cached_tail.replays == before[0]


def test_signatures_keep_their_own_trees_and_state_slots(emulated: None) -> None:
    cases = [(x, "a") for x in _steps(6, 0, (3, 8))] + [(x, "b") for x in _steps(6, 5, (5, 8))]
    order = [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]  # two shapes interleaved, one pool
    caches = {"a": ToyCache(0.05), "b": ToyCache(0.05)}
    twins = {"a": ToyCache(0.05), "b": ToyCache(0.05)}
    fn = toy_forward(_weights())
    current: dict[str, ToyCache] = {}
    runner = GraphRunner(fn, name="toy", capture_on_miss=True)

    class Both:
        def snapshot(self) -> Any:
            return {k: c.snapshot() for k, c in caches.items()}

        def restore(self, snap: Any) -> None:
            for k, c in caches.items():
                c.restore(snap[k])

    runner.state = Both()
    for i in order:
        x, which = cases[i]
        current[which] = caches[which]
        assert torch.equal(runner(x, caches[which]), fn(x, twins[which])), f"case {i}"
    assert runner.stats().entries == 2


def test_a_decision_must_return_a_small_host_value(emulated: None) -> None:
    @eager_on_graph(decision=True)
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    runner = GraphRunner(lambda x: bad(x) + 1, name="bad", capture_on_miss=True)
    out = runner(torch.ones(2))  # the capture fails, the call runs eagerly
    assert torch.equal(out, torch.tensor(3.0))
    (reason,) = runner.blocked.values()
    assert "decision" in reason and "bad" in reason and "returned a Tensor" in reason


def test_keeps_inputs_gets_owned_copies_at_capture_and_replay(emulated: None) -> None:
    kept: list[torch.Tensor] = []

    @eager_on_graph(keeps_inputs=True)
    def keep(t: torch.Tensor) -> None:
        kept.append(t)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 3
        keep(h)
        return h + 1

    runner = GraphRunner(fn, name="keep", capture_on_miss=True)
    runner(torch.ones(2))
    runner(torch.full((2,), 2.0))
    entry = next(iter(runner.store.entries.values()))
    (chain,) = entry.tree.chains.values()
    recorded = chain.graph.breaks[0].args[0]
    # every kept tensor is its own copy with the value of its call, never the segment's output
    assert all(t is not recorded for t in kept)
    assert [t.tolist() for t in kept[-2:]] == [[3.0, 3.0], [6.0, 6.0]]


def test_rerun_answers_the_first_breaks_from_the_memo() -> None:
    ran: list[str] = []

    @eager_on_graph(name="one")
    def one() -> int:
        ran.append("one")
        return 1

    @eager_on_graph(name="two")
    def two() -> int:
        ran.append("two")
        return 2

    with bcg.rerun(bcg.Memo([("one", 10)])):
        assert (one(), two()) == (10, 2)
    assert ran == ["two"]
    with pytest.raises(BreakError, match="not deterministic"), bcg.rerun(bcg.Memo([("two", 5)])):
        one()


def test_tree_refuses_chains_that_part_without_a_decision() -> None:
    def chain(names: list[str], values: list[Any]) -> Chain:
        g = bcg.BreakableCUDAGraph()
        kinds = iter(values)
        for n in names:
            v = next(kinds)
            decision = v is not None
            g.breaks.append(
                bcg._Break(
                    fn=lambda: None,
                    name=n,
                    args=(),
                    kwargs={},
                    buffer=None,
                    kind=marks.BreakKind(decision=decision),
                    value=v,
                )
            )
        return Chain(g, None, [], 0.0)

    t = GraphTree()
    t.add(chain(["mask", "decide", "store"], [None, True, None]))
    t.add(chain(["mask", "decide"], [None, False]))
    with pytest.raises(ValueError, match="exists already"):
        t.add(chain(["mask", "decide"], [None, False]))
    other = GraphTree()
    other.add(chain(["mask", "decide"], [None, True]))
    with pytest.raises(ValueError, match="through breaks"):
        other.add(chain(["rope", "decide"], [None, False]))
    assert segment_replays  # imported for the tests above


def _valid_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.tolist()]  # a data-dependent shape, from the host


def test_a_keyed_break_gets_a_chain_per_output_shape(emulated: None) -> None:
    keyed = eager_on_graph(_valid_rows, name="valid rows", keyed=True)

    def forward(fn: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = fn(x * 2, mask)
        return (rows @ rows.T).sum(0, keepdim=True) + x.sum()

    masks = [torch.tensor([True, True, False, True]), torch.tensor([True, False, False, False])]
    calls = [(torch.randn(4, 3), masks[i % 2]) for i in range(6)] + [(torch.randn(4, 3), masks[0])]
    want = [forward(_valid_rows, x, m) for x, m in calls]
    runner = GraphRunner(lambda x, m: forward(keyed, x, m), name="keyed", capture_on_miss=True)
    got = [runner(x, m) for x, m in calls]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}"
    st = runner.stats()
    assert st.entries == 1 and st.captures == 2 and st.path_captures == 1
    assert sorted(st.paths_per_entry[0]) == ["1x3 float32", "3x3 float32"]  # the break's output shapes
    assert st.eager_calls == 0 and st.replays == len(calls) and st.path_switches > 0


def test_paths_beyond_max_paths_run_eagerly(emulated: None) -> None:
    keyed = eager_on_graph(_valid_rows, name="valid rows", keyed=True)
    runner = GraphRunner(lambda x, m: keyed(x, m).sum(0), name="keyed", capture_on_miss=True, max_paths=2)
    xs = [torch.randn(4, 2) for _ in range(4)]
    masks = [torch.tensor([True] * (n + 1) + [False] * (3 - n)) for n in range(4)]  # 4 output shapes
    got = [runner(x, m) for x, m in zip(xs, masks)]
    assert all(torch.equal(g, x[m].sum(0)) for g, x, m in zip(got, xs, masks))
    st = runner.stats()
    assert len(st.paths_per_entry[0]) == 2 and st.eager_calls == 2
