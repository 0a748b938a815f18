"""The graph runner without CUDA: everything runs eagerly, correctly, and is counted.

The capture bookkeeping (eviction, blocking, the memory budget) is driven with the CUDA parts
faked: see :func:`fake_cuda`.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import GraphRunner
from accel.graphs import runner as runner_mod
from accel.graphs import tree
from accel.graphs.runner import GraphMemoryBudgetError, RunnerStats, capture_session
from tests.helpers.fakes import FakeCuda, FakePool


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def _fn(calls: list[Any]):
    def forward(x: torch.Tensor, t: torch.Tensor, *, scale: float = 1.0, return_dict: bool = True) -> Any:
        calls.append((x, t, scale))
        out = x * t[:, None] * scale
        return {"sample": out} if return_dict else (out,)

    return forward


def test_calls_run_eagerly_and_equal_the_function() -> None:
    calls: list[Any] = []
    fn = _fn(calls)
    runner = GraphRunner(fn, name="toy")
    torch.manual_seed(0)
    for i, shape in enumerate([(2, 3), (2, 3), (2, 5)]):
        x, t = torch.randn(*shape), torch.rand(shape[0])
        out = runner(x, t, scale=0.5, return_dict=bool(i % 2))
        want = fn(x, t, scale=0.5, return_dict=bool(i % 2))
        calls.pop()
        if i % 2:
            assert torch.equal(out["sample"], want["sample"])
        else:
            assert type(out) is tuple and torch.equal(out[0], want[0])
        # the function saw the caller's own tensors, not copies
        assert calls[-1][0] is x and calls[-1][1] is t
    st = runner.stats()
    assert isinstance(st, RunnerStats)
    assert (st.eager_calls, st.replays, st.captures, st.misses, st.capture_failures) == (3, 0, 0, 0, 0)
    assert (st.entries, st.segments_per_entry, st.pool_bytes, st.static_bytes, st.boundary_bytes) == (0, [], 0, 0, 0)
    assert runner.signatures == [] and runner.blocked == {}
    assert runner.stats().as_dict()["eager_calls"] == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_no_cuda_is_said_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import accel.graphs.runner as runner_mod

    monkeypatch.setattr(runner_mod, "_said_no_cuda", False)
    runners = [GraphRunner(lambda x: x + 1, name=name) for name in ("denoiser", "text_encoder")]
    with caplog.at_level(logging.INFO, logger="accel.graphs.runner"):
        for _ in range(3):
            for runner in runners:
                runner(torch.zeros(1))
    said = [r for r in caplog.records if "CUDA is not available" in r.getMessage()]
    assert len(said) == 1  # once per process: it is the machine, not the runner


def test_capture_returns_false_on_cpu_and_captures_nothing() -> None:
    calls: list[Any] = []
    runner = GraphRunner(_fn(calls), capture_on_miss=True)
    x, t = torch.ones(2, 3), torch.ones(2)
    assert runner.capture(x, t) is False
    assert calls == []  # not even a warm-up run
    with runner.capturing():
        out = runner(x, t)
    assert torch.equal(out["sample"], x)
    st = runner.stats()
    assert (st.captures, st.eager_calls, st.entries, st.capture_failures) == (0, 1, 0, 0)
    assert runner.blocked == {}  # nothing failed: there was simply no CUDA


@pytest.mark.parametrize("bad", [0, -1])
def test_max_entries_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        GraphRunner(lambda: None, max_entries=bad)


def test_release_is_harmless() -> None:
    runner = GraphRunner(lambda x: x * 2)
    runner.release()
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    runner.release()
    runner.release()
    assert runner.stats().eager_calls == 1 and runner.stats().entries == 0
    assert torch.equal(runner(torch.ones(1)), torch.full((1,), 2.0))


def test_capture_session_disables_gc_and_restores_it() -> None:
    gc.enable()
    with capture_session():
        assert not gc.isenabled()
        with capture_session():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner session ending does not re-enable it
    assert gc.isenabled()

    with pytest.raises(RuntimeError, match="boom"), capture_session():
        raise RuntimeError("boom")
    assert gc.isenabled()

    gc.disable()  # a caller that keeps gc off keeps it off
    with capture_session():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_runner_capturing_block_is_a_capture_session() -> None:
    gc.enable()
    runner = GraphRunner(lambda x: x)
    with runner.capturing():
        assert not gc.isenabled()
        assert runner._capturing == 1
    assert gc.isenabled() and runner._capturing == 0


@dataclasses.dataclass
class Output:
    sample: torch.Tensor
    extras: list
    label: str = "out"


Pair = collections.namedtuple("Pair", "a b")


def _tensors(obj: Any) -> list[torch.Tensor]:
    return tree.tensors(obj)


def _clone_output(obj: Any) -> Any:
    """What a replay returns for a captured output ``obj`` (flattened once at capture)."""
    return tree.Flat(obj).clone()


def test_clone_output_copies_every_tensor() -> None:
    src = (
        torch.zeros(2),
        [torch.zeros(1), 3, None],
        {"k": torch.zeros(3), "s": "name"},
        Output(sample=torch.zeros(2), extras=[torch.zeros(1), {"n": torch.zeros(1)}]),
        Pair(torch.zeros(1), 2),
    )
    clone = _clone_output(src)
    # same structure and types all the way down
    assert type(clone) is tuple and type(clone[1]) is list and type(clone[2]) is dict
    assert type(clone[3]) is Output and type(clone[4]) is Pair
    assert clone[1][1:] == [3, None] and clone[2]["s"] == "name" and clone[3].label == "out" and clone[4].b == 2
    src_t, clone_t = _tensors(src), _tensors(clone)
    assert len(src_t) == len(clone_t) == 7
    for s, c in zip(src_t, clone_t):
        assert torch.equal(s, c) and s.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    # modifying the clone leaves the source (the graph's output buffers) unchanged
    for c in clone_t:
        c.fill_(5.0)
    assert all(torch.count_nonzero(s) == 0 for s in src_t)


def test_clone_output_of_a_diffusers_output() -> None:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    src = Transformer2DModelOutput(sample=torch.zeros(1, 4))
    clone = _clone_output(src)
    assert type(clone) is Transformer2DModelOutput
    clone.sample.add_(1.0)
    assert torch.count_nonzero(src.sample) == 0
    assert torch.equal(clone["sample"], torch.ones(1, 4)) and clone[0] is clone.sample


def test_clone_output_never_aliases_inside_dict_subclasses_and_plain_objects() -> None:
    class Holder:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t
            self.tag = "x"

    src = collections.OrderedDict(a=torch.ones(2), b=[Holder(torch.zeros(3))])
    out = _clone_output(src)
    assert type(out) is collections.OrderedDict and type(out["b"][0]) is Holder and out["b"][0].tag == "x"
    out["a"].add_(1)
    out["b"][0].t.add_(1)
    assert torch.equal(src["a"], torch.ones(2)) and torch.equal(src["b"][0].t, torch.zeros(3))


# --------------------------------------------------------------------------------------------
# Capture sessions across threads
# --------------------------------------------------------------------------------------------
def test_overlapping_sessions_of_two_threads_leave_gc_enabled() -> None:
    """The first session to open takes gc's state; the last to close restores it, even when the
    first closes first (it used to leave gc off for the whole process)."""
    gc.enable()
    first_open, second_open, first_closed = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with capture_session():
                first_open.set()
                assert second_open.wait(10)
            first_closed.set()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def second() -> None:
        try:
            assert first_open.wait(10)
            with capture_session():
                second_open.set()
                assert first_closed.wait(10)
                seen.append(gc.isenabled())  # still capturing here: gc stays off
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert seen == [False]
    assert gc.isenabled()


# --------------------------------------------------------------------------------------------
# Capture bookkeeping with the CUDA parts faked
# --------------------------------------------------------------------------------------------
def _scale(x: torch.Tensor, *, by: float = 2.0) -> torch.Tensor:
    return x * by


def test_fake_cuda_captures_and_replays_correctly(fake_cuda: FakeCuda) -> None:
    runner = GraphRunner(_scale, name="toy", debug=True)
    with runner.capturing():
        runner(torch.ones(2, 3))
    assert fake_cuda.captures == 1 and runner.stats().entries == 1
    x = torch.randn(2, 3)
    out = runner(x)
    assert torch.equal(out, x * 2.0)
    assert runner.stats().replays == 2  # the capture call replays too


def test_failed_capture_does_not_evict_a_good_graph(fake_cuda: FakeCuda) -> None:
    """A capture used to evict the least recently used entry before it knew it would succeed."""
    runner = GraphRunner(_scale, name="lru", max_entries=1, capture_on_miss=True, debug=True)
    a = torch.randn(2, 3)
    assert torch.equal(runner(a), a * 2.0)
    (kept,) = runner.signatures

    fake_cuda.fail_next_capture = True
    b = torch.randn(4, 3)
    assert torch.equal(runner(b), b * 2.0)  # ran eagerly
    st = runner.stats()
    assert (st.capture_failures, st.evictions, st.entries) == (1, 0, 1)
    assert runner.signatures == [kept] and len(runner.blocked) == 1

    a2 = torch.randn(2, 3)
    assert torch.equal(runner(a2), a2 * 2.0)  # the good graph still replays
    assert runner.stats().replays == 2 and runner.stats().eager_calls == 1

    # a capture that succeeds evicts the old entry, never itself
    c = torch.randn(5, 3)
    assert torch.equal(runner(c), c * 2.0)
    st = runner.stats()
    assert (st.captures, st.evictions, st.entries) == (2, 1, 1)
    assert runner.signatures[0].key != kept.key
    assert torch.equal(runner(c), c * 2.0) and runner.stats().replays == 4


def test_release_recapture_keeps_the_signatures_already_waiting_to_be_captured(fake_cuda: FakeCuda) -> None:
    """A signature dropped as stale and not called since stays due for capture through a second
    release: only a release without ``recapture`` forgets it."""
    runner = GraphRunner(_scale, name="stale", debug=True)  # no capture on first use
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    with runner.capturing():
        runner(a)
        runner(b)
    assert runner.stats().captures == 2
    assert runner.release(recapture=True) == 2
    c = torch.randn(2, 3)
    assert torch.equal(runner(c), c * 2.0)  # a's signature: captured again on its next call
    st = runner.stats()
    assert (st.captures, st.entries) == (3, 1)
    # b's signature was not called: it is still waiting when the graphs are dropped again.
    assert runner.release(recapture=True) == 1
    assert runner.release(recapture=True) == 0
    assert len(runner.store.recapture) == 2
    for x in (torch.randn(4, 3), torch.randn(2, 3)):
        assert torch.equal(runner(x), x * 2.0)
    st = runner.stats()
    assert (st.captures, st.entries, st.misses) == (5, 2, 0)
    assert not runner.store.recapture
    # A release without recapture forgets what was waiting: the next call is a miss.
    runner.release(recapture=True)
    runner.release()
    d = torch.randn(4, 3)
    assert torch.equal(runner(d), d * 2.0)
    st = runner.stats()
    assert (st.captures, st.misses) == (5, 1)


def test_memory_budget_refusal_is_a_graph_memory_budget_error(fake_cuda: FakeCuda) -> None:
    assert issubclass(GraphMemoryBudgetError, RuntimeError) and not issubclass(GraphMemoryBudgetError, MemoryError)
    assert "GraphMemoryBudgetError" in runner_mod.__all__
    FakePool.resident = 3 * 2**20
    runner = GraphRunner(_scale, name="budget", capture_on_miss=True, debug=True, memory_budget=2**20)
    x = torch.randn(2, 3)
    assert torch.equal(runner(x), x * 2.0)
    (reason,) = runner.blocked.values()
    assert reason == "GraphMemoryBudgetError: graph memory would be 3 MiB, over the budget of 1 MiB"
    st = runner.stats()
    assert (st.captures, st.capture_failures, st.entries, st.eager_calls) == (0, 1, 0, 1)


def test_memory_budget_does_not_count_the_entry_a_capture_evicts(fake_cuda: FakeCuda) -> None:
    # one entry: 24 bytes of static input and 24 of boundary buffer (debug: the output)
    runner = GraphRunner(_scale, name="budget", max_entries=1, capture_on_miss=True, debug=True, memory_budget=60)
    x = torch.randn(2, 3)
    runner(x, by=2.0)
    runner(x, by=3.0)  # another signature: 48 bytes with the first evicted, 96 without
    st = runner.stats()
    assert (st.captures, st.evictions, st.capture_failures, st.entries) == (2, 1, 0, 1)
    assert torch.equal(runner(x, by=3.0), x * 3.0)


def test_block_drops_a_graph_and_runs_its_signature_eagerly(fake_cuda: FakeCuda) -> None:
    runner = GraphRunner(_scale, name="block", capture_on_miss=True, debug=True)
    x = torch.randn(2, 3)
    runner(x)
    (sig,) = runner.signatures
    runner.block([sig.key], "another process failed to capture it")
    assert runner.stats().entries == 0 and runner.blocked == {sig.key: "another process failed to capture it"}
    eager0 = runner.stats().eager_calls
    assert torch.equal(runner(x), x * 2.0)  # capture_on_miss does not capture a blocked signature
    st = runner.stats()
    assert st.eager_calls == eager0 + 1 and st.captures == 1 and fake_cuda.captures == 1
