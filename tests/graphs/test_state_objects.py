"""Request-scoped state (accel.graphs.signature and accel.graphs.stores) on emulated CUDA graphs.

A per-call object of tensors (a prefix K/V cache, tests/graphs/state_toy.py) whose type the runner
is given as state is keyed by its structure, never by its identity; the extract step's graph
writes it and every replay puts into the caller's object what an eager call would have; the
cached steps' graphs read it. Every run is compared, outputs and caches, bit for bit with the
same model run eagerly.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from accel.graphs.runner import GraphRunner
from accel.graphs.signature import Unopenable, describe_diff, flatten
from tests.graphs.state_toy import ToyCache, ToyLayerCache, ToyPrefixModel, denoise
from tests.helpers.emulator import emulate_cuda

STATE = frozenset({ToyCache})


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_cuda(monkeypatch)


def runner_of(fn: Any, state: frozenset[type] = STATE, **settings: Any) -> GraphRunner:
    runner = GraphRunner(fn, name="toy", **settings)
    runner.state_types = state
    return runner


def same_cache(a: ToyCache, b: ToyCache) -> bool:
    if a.prefix_len != b.prefix_len or len(a.layers) != len(b.layers):
        return False
    for x, y in zip(a.layers, b.layers):
        for name in ("k", "v"):
            p, q = getattr(x, name), getattr(y, name)
            if (p is None) != (q is None) or (p is not None and not torch.equal(p, q)):
                return False
    return True


# -- signatures ---------------------------------------------------------------------------------
def test_a_state_object_is_keyed_by_its_structure_never_its_identity() -> None:
    x = torch.randn(1, 4, 8)
    empty_a, empty_b = ToyCache(2), ToyCache(2)
    key = flatten((x,), {"kv_cache": empty_a}, STATE)[0]
    assert flatten((x,), {"kv_cache": empty_b}, STATE)[0].key == key.key and key.objects == ()
    full = ToyCache(2)
    for layer in full.layers:
        layer.store(torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    full_sig, leaves = flatten((x,), {"kv_cache": full}, STATE)
    assert len(leaves) == 5 and leaves[1] is full.layers[0].k  # the cache's tensors are inputs
    assert full_sig.state_inputs == (1, 2, 3, 4)
    assert describe_diff(full_sig, key)[0] == "kv_cache.layers[0].k: tensor[1, 5, 8] float32 on cpu vs None"
    longer = ToyCache(2)
    for layer in longer.layers:
        layer.store(torch.randn(1, 6, 8), torch.randn(1, 6, 8))
    assert flatten((x,), {"kv_cache": longer}, STATE)[0].key != full_sig.key
    assert flatten((x,), {"kv_cache": ToyCache(3)}, STATE)[0].key != key.key
    # A type not named as state is matched by identity, as before: a long-lived object whose
    # graphs read its tensors by address and call its methods as breaks (a step cache's).
    as_object, no_tensors = flatten((x,), {"kv_cache": full})
    assert as_object.objects == (full,) and no_tensors == [x] and as_object.state_inputs == ()
    # Rebuilt for a capture: an object of the same class and attributes around the new tensors.
    new = [torch.zeros_like(t) for t in leaves]
    _, kwargs = full_sig.rebuild(new)
    rebuilt = kwargs["kv_cache"]
    assert type(rebuilt) is ToyCache and rebuilt is not full and type(rebuilt.layers[1]) is ToyLayerCache
    assert rebuilt.layers[0].k is new[1] and rebuilt.layer(1).get()[1] is new[4]


class Made:
    """Allocated by a ``__new__`` of its own: a copy made like copy.copy may not be what it is."""

    def __new__(cls, *args: Any) -> Made:
        return super().__new__(cls)

    def __init__(self, t: Any) -> None:
        self.t = t


class Base:
    __slots__ = ("hidden",)


class Slotted(Base):
    def __init__(self, t: Any) -> None:
        self.hidden = t


@pytest.mark.parametrize("holder", [Made, Slotted], ids=["own __new__", "slots"])
def test_state_that_cannot_be_opened_is_refused_only_when_it_holds_tensors(holder: type) -> None:
    named = frozenset({holder})
    with pytest.raises(Unopenable, match=r"^state is a .*, request-scoped state holding tensors"):
        flatten((torch.zeros(1),), {"state": holder([torch.zeros(2)])}, named)
    # Inside an object that is opened, too.
    inside = ToyCache(1)
    inside.layers[0].k = holder(torch.zeros(2))
    with pytest.raises(Unopenable, match=r"^state.layers\[0\].k is a "):
        flatten((torch.zeros(1),), {"state": inside}, STATE)
    # Holding no tensor, it is kept by identity as before: nothing of it is read by address.
    plain = holder([1, 2])
    sig = flatten((torch.zeros(1),), {"state": plain}, named)[0]
    assert sig.objects == (plain,)
    # And a type not named as state is not looked into.
    assert flatten((torch.zeros(1),), {"state": holder([torch.zeros(2)])})[0].objects[0].__class__ is holder


def test_a_refused_object_runs_eagerly_with_one_warning(emulated: None, caplog: pytest.LogCaptureFixture) -> None:
    def step(x: torch.Tensor, state: Made) -> torch.Tensor:
        return x + state.t

    runner = runner_of(step, frozenset({Made}), capture_on_miss=True)
    with caplog.at_level(logging.WARNING, logger="accel.graphs.runner"):
        for i in range(3):
            state = Made(torch.full((2,), float(i)))
            x = torch.randn(2)
            assert torch.equal(runner(x, state=state), x + state.t)
    st = runner.stats()
    assert st.eager_calls == 3 and st.captures == 0 and st.replays == 0
    warned = [r for r in caplog.records if "holding tensors" in r.getMessage()]
    assert len(warned) == 1 and "state is a tests.graphs.test_state_objects.Made" in warned[0].getMessage()


# -- the given form: the extract step stores into the caller's object ----------------------------
@pytest.mark.parametrize("returned", [False, True], ids=["given", "returned"])
def test_cfg_calls_replay_every_step_and_equal_eager(emulated: None, returned: bool) -> None:
    model = ToyPrefixModel()
    fn = model.forward_returning if returned else model.forward
    runner = runner_of(fn)
    with runner.capturing():
        denoise(runner, model, seed=0, returned=returned)
    warm = runner.stats()
    # Two signatures: extract (an empty cache or none) and cached (a full one); cond and uncond share both.
    assert warm.captures == 2 and warm.eager_calls == 0, runner.blocked
    for seed in (1, 2, 3):
        want, want_caches = denoise(fn, model, seed, returned=returned)
        got, caches = denoise(runner, model, seed, returned=returned)
        assert torch.equal(got, want)
        assert all(same_cache(a, b) for a, b in zip(caches, want_caches, strict=True))
    st = runner.stats()
    assert st.misses == 0 and st.eager_calls == 0 and st.captures == 2 and st.replays - warm.replays == 3 * 6


def test_an_eager_call_after_a_replay_reads_the_state_the_replay_left(emulated: None) -> None:
    model = ToyPrefixModel()
    runner = runner_of(model.forward, capture_on_miss=True)
    x, t = torch.randn(1, 9, 8), torch.ones(1)
    for _ in range(2):  # a capture, then a replay
        cache, want_cache = ToyCache(3), ToyCache(3)
        runner(x, t, kv_cache=cache, mode="extract", prefix=5)
        model(x, t, kv_cache=want_cache, mode="extract", prefix=5)
        assert same_cache(cache, want_cache)
    assert runner.stats().replays == 2
    # The cached step eagerly (the model itself), on what the replay stored: as on eager's state.
    y = torch.randn(1, 4, 8)
    assert torch.equal(model(y, t, kv_cache=cache, mode="cached"), model(y, t, kv_cache=want_cache, mode="cached"))


def test_two_calls_interleaved_in_shuffled_order_keep_their_own_state(emulated: None) -> None:
    """Several requests' caches alive at once, for two prefix lengths sharing the pool."""
    model = ToyPrefixModel()
    runner = runner_of(model.forward)
    t = torch.ones(1)
    with runner.capturing():
        for prefix in (7, 5):
            c = ToyCache(3)
            runner(torch.randn(1, prefix + 4, 8), t, kv_cache=c, mode="extract", prefix=prefix)
            runner(torch.randn(1, 4, 8), t, kv_cache=c, mode="cached")
    requests = [(p, torch.randn(1, p + 4, 8), torch.randn(1, 4, 8)) for p in (5, 7, 5, 7, 5)]
    random.Random(0).shuffle(requests)
    caches = [(ToyCache(3), ToyCache(3)) for _ in requests]
    for (prefix, x, _), (cache, want) in zip(requests, caches):
        got = runner(x, t, kv_cache=cache, mode="extract", prefix=prefix)
        assert torch.equal(got, model(x, t, kv_cache=want, mode="extract", prefix=prefix))
    for step in range(2):
        for (_, _, y), (cache, want) in zip(requests, caches):
            y = y + step
            assert torch.equal(runner(y, t, kv_cache=cache, mode="cached"), model(y, t, kv_cache=want, mode="cached"))
            assert same_cache(cache, want)
    st = runner.stats()
    assert st.captures == 4 and st.misses == 0 and st.eager_calls == 0


def test_poisoned_graph_memory_changes_nothing_the_caller_holds(emulated: None) -> None:
    model = ToyPrefixModel()
    runner = runner_of(model.forward)
    with runner.capturing():
        denoise(runner, model, seed=0)

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = runner(*args, **kwargs)
        for entry in runner.store.entries.values():
            for chain in entry.tree.chains.values():
                chain.flat_output.tensors[0].fill_(float("nan"))
                for made in chain.stores.made if chain.stores is not None else ():
                    made.fill_(float("nan"))
        return out

    want, want_caches = denoise(model, model, seed=4)
    got, caches = denoise(poisoned, model, seed=4)
    assert torch.equal(got, want) and all(same_cache(a, b) for a, b in zip(caches, want_caches))


def test_what_the_extract_step_stores_is_put_back_as_attributes(emulated: None) -> None:
    """Attributes the call adds or removes come and go as eagerly; constants are put back as they are."""

    def step(x: torch.Tensor, state: Any) -> torch.Tensor:
        state.seen = x * 2
        state.count = state.count + 1
        del state.scratch
        return x + 1

    class State:
        def __init__(self) -> None:
            self.count = 0
            self.scratch = "drop me"

    runner = runner_of(step, frozenset({State}), capture_on_miss=True)
    for seed in range(3):
        x = torch.randn(2, generator=torch.Generator().manual_seed(seed))
        state, want = State(), State()
        assert torch.equal(runner(x, state), step(x, want))
        assert vars(state).keys() == vars(want).keys() and state.count == 1 and torch.equal(state.seen, want.seen)
    assert runner.stats().replays == 3 and not runner.blocked


# -- what the cached steps copy ------------------------------------------------------------------
def _cached_steps(fn: Any, cache: ToyCache, steps: int, seed: int, touch: Any = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y, t, outs = torch.randn(1, 4, 8, generator=g), torch.ones(1), []
    for step in range(steps):
        if touch is not None:
            touch(step, cache)
        y = fn(y, t, kv_cache=cache, mode="cached")
        outs.append(y)
    return outs


def _filled(model: ToyPrefixModel, seed: int) -> tuple[ToyCache, ToyCache]:
    x = torch.randn(1, 9, 8, generator=torch.Generator().manual_seed(seed))
    a, b = ToyCache(3), ToyCache(3)
    model(x, torch.ones(1), kv_cache=a, mode="extract", prefix=5)
    model(x, torch.ones(1), kv_cache=b, mode="extract", prefix=5)
    return a, b


def test_a_state_unchanged_since_the_last_step_is_not_copied_again(emulated: None) -> None:
    model = ToyPrefixModel()
    runner = runner_of(model.forward, capture_on_miss=True)
    for seed in range(3):
        cache, want_cache = _filled(model, seed)
        got, want = _cached_steps(runner, cache, 4, seed), _cached_steps(model, want_cache, 4, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = runner.stats()
    per_step = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    # Each call copies its cache once (a new cache, new tensors), then its three later steps find it in place.
    assert st.replays == 12 and st.captures == 1 and st.state_bytes_kept == 3 * 3 * per_step, st


def test_cond_and_uncond_caches_alternating_are_copied_at_every_step(emulated: None) -> None:
    """True CFG: one graph for both branches' caches, so each step copies the branch's cache in."""
    model = ToyPrefixModel()
    runner = runner_of(model.forward)
    with runner.capturing():
        denoise(runner, model, seed=0)
    before = runner.stats()
    denoise(runner, model, seed=1)
    assert runner.stats().state_bytes_kept == before.state_bytes_kept


def _scale_k(step: int, cache: ToyCache) -> None:
    if step == 2:
        cache.layers[1].k.mul_(0.5)  # the caller writes into its own cache


def _replace_v(step: int, cache: ToyCache) -> None:
    if step == 2:
        cache.layers[0].v = cache.layers[0].v + 1  # another tensor of the same shape


@pytest.mark.parametrize("touch", [_scale_k, _replace_v], ids=["written-in-place", "replaced"])
def test_a_state_the_caller_changed_between_steps_is_copied_again(emulated: None, touch: Any) -> None:
    model = ToyPrefixModel()
    runner = runner_of(model.forward, capture_on_miss=True)
    cache, want_cache = _filled(model, 0)
    got, want = _cached_steps(runner, cache, 4, 0, touch), _cached_steps(model, want_cache, 4, 0, touch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    per_step = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    st = runner.stats()
    one = per_step // (2 * len(cache.layers))
    # Copied whole at the first step; then found in place, but for the changed tensor at the changed step.
    assert st.replays == 4 and st.state_bytes_kept == 3 * per_step - one, st


def test_inference_tensors_are_always_copied(emulated: None) -> None:
    model = ToyPrefixModel()
    runner = runner_of(model.forward, capture_on_miss=True)
    with torch.inference_mode():
        cache, want_cache = _filled(model, 0)
        got, want = _cached_steps(runner, cache, 3, 0, _scale_k), _cached_steps(model, want_cache, 3, 0, _scale_k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = runner.stats()
    assert st.replays == 3 and st.state_bytes_kept == 0


def test_a_call_that_writes_into_its_state_in_place_is_refused(emulated: None) -> None:
    def decay(x: torch.Tensor, kv_cache: ToyCache) -> torch.Tensor:
        k = kv_cache.layers[0].k
        k.mul_(0.9)  # eagerly the caller's cache decays; a replay would decay the graph's copy
        return x + k.sum()

    runner = runner_of(decay, capture_on_miss=True)
    cache, want = ToyCache(1), ToyCache(1)
    cache.layers[0].k, want.layers[0].k = torch.ones(2), torch.ones(2)
    for _ in range(3):
        x = torch.randn(2)
        assert torch.equal(runner(x, kv_cache=cache), decay(x, want)) and torch.equal(
            cache.layers[0].k, want.layers[0].k
        )
    assert runner.stats().replays == 0
    (reason,) = runner.blocked.values()
    assert "writes in place into kv_cache.layers[0].k, a tensor of a state object" in reason, reason


def test_a_miss_on_an_object_per_call_says_its_type_can_be_named_as_state() -> None:
    x = torch.randn(1, 4, 8)
    a, b = flatten((x,), {"kv_cache": ToyCache(2)})[0], flatten((x,), {"kv_cache": ToyCache(2)})[0]
    (diff,) = describe_diff(a, b)
    assert diff.startswith("kv_cache: <tests.graphs.state_toy.ToyCache object> vs <tests.graphs.state_toy.ToyCache")
    assert diff.endswith("(another object of the type: one per call is state its recipe can name)")


def test_a_verified_capture_compares_what_the_state_holds_after_it(emulated: None) -> None:
    """``verify``: the capture's replay against an eager run, the caches they fill included."""
    model = ToyPrefixModel()
    runner = runner_of(model.forward, verify=True)
    with runner.capturing():
        denoise(runner, model, seed=0)
    want, want_caches = denoise(model, model, seed=1)
    got, caches = denoise(runner, model, seed=1)
    assert torch.equal(got, want) and all(same_cache(a, b) for a, b in zip(caches, want_caches))
    assert runner.stats().captures == 2 and not runner.blocked


def test_a_capture_whose_graph_stores_other_values_than_eager_is_refused(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verification sees the state: a replay that left other K/V than eager fails it."""
    from accel.graphs import stores as stores_mod

    real_apply = stores_mod.Stores.apply

    def wrong(self: Any, args: Any, kwargs: Any, inputs: Any, output: Any) -> None:
        real_apply(self, args, kwargs, inputs, output)
        kwargs["kv_cache"].layers[0].k = kwargs["kv_cache"].layers[0].k + 1

    monkeypatch.setattr(stores_mod.Stores, "apply", wrong)
    model = ToyPrefixModel()
    runner = runner_of(model.forward, verify=True, capture_on_miss=True)
    cache = ToyCache(3)
    runner(torch.randn(1, 9, 8), torch.ones(1), kv_cache=cache, mode="extract", prefix=5)
    (reason,) = runner.blocked.values()
    assert "differs from an eager run" in reason, reason
