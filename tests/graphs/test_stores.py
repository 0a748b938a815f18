"""Calls that store into the containers they are given, on emulated CUDA graphs (accel.graphs.stores).

A replay runs no Python; the capture records what the call left in each list or dict it was
given, and every replay puts the same contents into the caller's containers. The toy causal
decoder (tests/graphs/causal_toy.py) decodes frame by frame, each call reading what the previous
one stored; every accelerated run is compared, frame and cache, bit for bit with the same module
run eagerly.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from accel.graphs import stores
from accel.graphs.bcg import eager_on_graph
from accel.graphs.runner import GraphRunner
from accel.graphs.signature import describe_diff, flatten
from tests.graphs.causal_toy import ToyCausalDecoder, decode
from tests.helpers.emulator import emulate_cuda


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_cuda(monkeypatch)


def same(a: Any, b: Any) -> bool:
    """Equal bit for bit, through lists, tuples and dicts; constants by value and type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if both and a.device.type == "meta":
            return b.device.type == "meta" and a.shape == b.shape
        return both and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def latents(frames: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 4, frames, width, generator=torch.Generator().manual_seed(seed))


# -- signatures -------------------------------------------------------------------------------
def test_the_signature_keys_on_what_the_containers_hold_at_entry() -> None:
    x, t = torch.randn(2), torch.randn(3)
    calls = {
        "first frame": ((x,), {"feat_cache": [None, None], "feat_idx": [0]}),
        "a tensor stored": ((x,), {"feat_cache": [t, None], "feat_idx": [0]}),
        "Rep stored": ((x,), {"feat_cache": ["Rep", None], "feat_idx": [0]}),
        "another count": ((x,), {"feat_cache": [None, None], "feat_idx": [1]}),
        "another shape": ((x,), {"feat_cache": [torch.randn(4), None], "feat_idx": [0]}),
    }
    keys = {name: flatten(*call)[0] for name, call in calls.items()}
    assert len({s.key for s in keys.values()}) == len(calls)
    assert describe_diff(keys["a tensor stored"], keys["first frame"]) == [
        "feat_cache[0]: tensor[3] float32 on cpu vs None"
    ]
    assert describe_diff(keys["another count"], keys["first frame"]) == ["feat_idx[0]: 1 vs 0"]
    # Two calls that hold alike share one signature (the values of tensors are copied in).
    again = flatten((torch.randn(2),), {"feat_cache": [torch.randn(3), None], "feat_idx": [0]})[0]
    assert again.key == keys["a tensor stored"].key


# -- frame by frame ----------------------------------------------------------------------------
def test_frame_by_frame_decoding_replays_and_equals_eager(emulated: None) -> None:
    dec = ToyCausalDecoder()
    z = latents(5, 8, seed=1)
    want, want_cache = decode(dec, z, dec.slots)
    runner = GraphRunner(dec.forward, name="toy-decoder")
    with runner.capturing():
        got, cache = decode(runner, z, dec.slots)
    assert same(got, want) and same(cache, want_cache)
    st = runner.stats()
    # Frame 0 (an empty cache), frame 1 (the first frame's "Rep" and one-frame caches), then frames
    # 2.. (two-frame caches) share one signature.
    assert st.captures == 3 and st.eager_calls == 0 and st.capture_failures == 0, runner.blocked
    assert isinstance(cache[1], torch.Tensor) and cache[0].shape[2] == 2
    # A second video: every frame replays, and reads what the replay before it stored.
    z2 = latents(5, 8, seed=2)
    want2, want_cache2 = decode(dec, z2, dec.slots)
    got2, cache2 = decode(runner, z2, dec.slots)
    assert same(got2, want2) and same(cache2, want_cache2)
    after = runner.stats()
    assert after.replays - st.replays == 5 and after.captures == 3 and after.eager_calls == 0


def test_first_frame_stores_rep_and_counts_its_slots(emulated: None) -> None:
    dec = ToyCausalDecoder()
    runner = GraphRunner(dec.forward, name="toy-decoder", capture_on_miss=True)
    x = latents(1, 8, seed=3)
    for _ in range(2):  # a capture, then a replay
        cache: list[Any] = [None] * dec.slots
        idx = [0]
        runner(x, feat_cache=cache, feat_idx=idx)
        assert idx == [3] and cache[1] == "Rep" and all(isinstance(cache[i], torch.Tensor) for i in (0, 2))
    assert runner.stats().replays == 2


def test_signatures_share_the_pool_in_shuffled_order_and_interleaved(emulated: None) -> None:
    # Two widths, several videos, decoded frame by frame in turns: two videos' caches are alive at
    # once for the same signatures, so each must own what it was given.
    dec = ToyCausalDecoder()
    runner = GraphRunner(dec.forward, name="toy-decoder")
    with runner.capturing():
        for width in (12, 8):
            decode(runner, latents(3, width, seed=0), dec.slots)
    videos = [latents(3, w, seed=10 + i) for i, w in enumerate([8, 12, 8, 12, 8])]
    random.Random(0).shuffle(videos)
    caches: list[list[Any]] = [[None] * dec.slots for _ in videos]
    want_caches: list[list[Any]] = [[None] * dec.slots for _ in videos]
    for frame in range(3):
        for z, cache, want_cache in zip(videos, caches, want_caches):
            x = z[:, :, frame : frame + 1].contiguous()
            want = dec(x, feat_cache=want_cache, feat_idx=[0])
            got = runner(x, feat_cache=cache, feat_idx=[0])
            assert same(got, want) and same(cache, want_cache), frame
    st = runner.stats()
    assert st.eager_calls == 0 and st.misses == 0 and st.captures == 6 and len(runner.keys) == 6


def test_poisoned_graph_memory_and_outputs_change_nothing_the_caller_holds(emulated: None) -> None:
    dec = ToyCausalDecoder()
    z = latents(4, 8, seed=4)
    want, want_cache = decode(dec, z, dec.slots)
    runner = GraphRunner(dec.forward, name="toy-decoder")
    with runner.capturing():
        decode(runner, z, dec.slots)

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = runner(*args, **kwargs)
        # What the graphs hold: output buffers and the stored tensors (the next replay rewrites them).
        for entry in runner.store.entries.values():
            for chain in entry.tree.chains.values():
                chain.flat_output.tensors[0].fill_(float("nan"))
                for t in chain.stores.made if chain.stores is not None else ():
                    t.fill_(float("nan"))
        return out

    got, cache = decode(poisoned, z, dec.slots)
    assert same(got, want) and same(cache, want_cache)


# -- what a store can be -------------------------------------------------------------------------
def test_inputs_outputs_and_views_come_back_as_eagerly(emulated: None) -> None:
    def step(x: torch.Tensor, cache: dict[str, Any]) -> torch.Tensor:
        out = x * 2 + cache.get("prev", 0)
        cache["prev"] = out  # the output itself
        cache["input"] = x  # an input
        cache["slice"] = (x * 3)[1:]  # a view of memory the caller never sees: a copy of its values
        cache["seen"] = True
        return out

    runner = GraphRunner(step, name="toy", capture_on_miss=True)
    eager: dict[str, Any] = {}
    cache: dict[str, Any] = {}
    for i in range(4):
        x = torch.randn(3, generator=torch.Generator().manual_seed(i))
        want = step(x, eager)
        got = runner(x, cache)
        assert same(got, want) and same(cache, eager)
        assert cache["prev"] is got and cache["input"] is x  # shared as eagerly
        got.mul_(0)  # the caller writes into its output: the container shares it, as eagerly
        want.mul_(0)
        assert same(cache, eager)
    st = runner.stats()
    # Two signatures: an empty cache, then a full one.
    assert st.captures == 2 and st.replays == 4 and cache["seen"] is True, runner.blocked


def test_containers_nested_in_args_and_kwargs(emulated: None) -> None:
    def step(x: torch.Tensor, state: tuple[dict[str, list[Any]], int], *, log: dict[str, Any]) -> torch.Tensor:
        slots = state[0]["slots"]
        prev = slots[0] if slots[0] is not None else torch.zeros_like(x)
        slots[0] = prev + x
        slots.append("seen")
        log["last"] = (slots[0] * 3).sum()
        return slots[0] - 1

    def run(fn: Any) -> tuple[list[torch.Tensor], Any, Any]:
        state: tuple[dict[str, list[Any]], int] = ({"slots": [None]}, 7)
        log: dict[str, Any] = {}
        outs = []
        for i in range(3):
            x = torch.full((2,), float(i))
            outs.append(fn(x, state, log=log))
            state[0]["slots"][1:] = []  # the caller trims what it does not want
        return outs, state, log

    want = run(step)
    runner = GraphRunner(step, name="nested", capture_on_miss=True)
    got = run(runner)
    assert same(list(got[0]), list(want[0])) and same(got[1][0], want[1][0]) and same(got[2], want[2])
    assert runner.stats().replays == 3 and not runner.blocked


# -- refusals ----------------------------------------------------------------------------------
OUTSIDE = torch.randn(3)


def _stores_outside(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    cache[0] = OUTSIDE
    return x + 1


def _stores_an_object(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    cache[0] = [x * 2]
    return x + 1


def _stores_on_another_device(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    cache[0] = torch.empty(2, device="meta")
    return x + 1


@eager_on_graph(name="keep")
def _keep(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    cache[0] = x * 2
    return x + 1


def _stores_a_view_of_the_output(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    out = x + 1
    cache[0] = out[:1]
    return out


def _stores_a_view_of_an_input(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    cache[0] = x[1:]
    return x + 1


def _stores_two_views_of_one_tensor(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    t = x * 2
    cache[0] = t[:1]
    cache.append(t[1:])
    return x + 1


def _stores_in_a_break(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    return _keep(x * 3, cache) * 2


@pytest.mark.parametrize(
    ("fn", "settings", "why"),
    [
        (_stores_outside, {}, "stores into args[1][0] a tensor it did not make"),
        (_stores_an_object, {}, "stores a list into args[1][0], which a replay cannot put back"),
        (_stores_on_another_device, {}, "stores into args[1][0] a tensor on meta"),
        (_stores_a_view_of_the_output, {}, "stores into args[1][0] a view of the output"),
        (_stores_a_view_of_an_input, {}, "stores into args[1][0] a view of an input"),
        (_stores_two_views_of_one_tensor, {}, "stores into args[1][1] a view of the tensor stored at args[1][0]"),
        (_stores_in_a_break, {}, "break 'keep' stores into args[1], a container given to the call"),
        (lambda x, cache: cache.__setitem__(0, x * 2) or x, {"debug": True}, "stores into args[1]"),
        (lambda x, cache: cache.__setitem__(0, x * 2) or x, {"warmup_runs": 0}, "needs a warm-up run"),
    ],
    ids=["outside", "object", "device", "view-of-output", "view-of-input", "two-views", "break", "debug", "no-warmup"],
)
def test_what_cannot_be_replayed_is_refused_naming_the_field(emulated: None, fn: Any, settings: dict, why: str) -> None:
    runner = GraphRunner(fn, name="toy", capture_on_miss=True, **settings)
    for _ in range(2):
        x = torch.randn(3)
        want_cache: list[Any] = [None]
        want = fn(x, want_cache)
        cache: list[Any] = [None]
        got = runner(x, cache)
        assert same(got, want) and same(cache, want_cache)  # eagerly, as it was
    st = runner.stats()
    assert st.replays == 0 and st.capture_failures == 1 and st.eager_calls == 2
    (reason,) = runner.blocked.values()
    assert why in reason, reason


def test_a_dataclass_field_set_by_the_call_is_put_back(emulated: None) -> None:
    import dataclasses

    @dataclasses.dataclass
    class State:
        last: Any = None

    def step(x: torch.Tensor, state: State) -> torch.Tensor:
        state.last = x * 2
        return x + 1

    runner = GraphRunner(step, name="toy", capture_on_miss=True)
    for seed in range(3):  # a capture, then replays
        x = torch.randn(2, generator=torch.Generator().manual_seed(seed))
        state, eager = State(), State()
        assert same(runner(x, state), step(x, eager)) and same(state.last, eager.last)
    st = runner.stats()
    assert st.captures == 1 and st.replays == 3 and not runner.blocked


def test_a_container_given_twice_runs_eagerly(emulated: None, caplog: pytest.LogCaptureFixture) -> None:
    def step(x: torch.Tensor, a: list[Any], b: list[Any]) -> torch.Tensor:
        a[0] = x * 2
        return x + (b[0] if b[0] is not None else 0)

    runner = GraphRunner(step, name="toy", capture_on_miss=True)
    runner(torch.randn(2), [None], [None])  # captured, with two containers
    shared: list[Any] = [None]
    x = torch.randn(2)
    want = step(x, want_shared := [None], want_shared)
    with caplog.at_level("INFO"):
        got = runner(x, shared, shared)
    assert same(got, want) and same(shared, want_shared)
    assert runner.stats().eager_calls == 1
    assert "args[2] is a container given twice in one call" in caplog.text


# -- paths, verification, memory ---------------------------------------------------------------
_decide = eager_on_graph(lambda x: bool(x.sum() > 0), name="sign", decision=True)


def test_each_decision_path_stores_its_own_and_verification_compares_stores(emulated: None) -> None:
    def step(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
        if _decide(x):
            cache[0] = x * 2
        else:
            cache[0] = "negative"
        return x + 1

    runner = GraphRunner(step, name="toy", capture_on_miss=True, verify=True)
    for sign in (1, -1, 1, -1):
        x = torch.full((3,), float(sign))
        want_cache: list[Any] = [None]
        cache: list[Any] = [None]
        assert same(runner(x, cache), step(x, want_cache)) and same(cache, want_cache)
    st = runner.stats()
    assert st.eager_calls == 0 and st.replays == 4 and st.paths_per_entry == [["True", "False"]], runner.blocked


def test_stored_bytes_are_what_the_chains_hold(emulated: None) -> None:
    dec = ToyCausalDecoder()
    runner = GraphRunner(dec.forward, name="toy-decoder")
    with runner.capturing():
        decode(runner, latents(3, 8, seed=0), dec.slots)
    held = [
        t
        for entry in runner.store.entries.values()
        for chain in entry.tree.chains.values()
        if chain.stores is not None
        for t in chain.stores.made
    ]
    # Frame 0 stores two one-frame caches; frames 1 and 2 three two-frame caches each (of 4 x 8 floats).
    assert sorted(t.shape[2] for t in held) == [1, 1, 2, 2, 2, 2, 2, 2]
    assert runner.stats().stored_bytes == sum(t.numel() * t.element_size() for t in held) == (2 + 12) * 32 * 4
    assert isinstance(stores.Stores, type)
