"""The graph runner without CUDA: everything runs eagerly, correctly, and is counted."""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
from typing import Any, Iterator

import pytest
import torch

from accel import GraphRunner, RunnerStats
from accel.runner import _clone_output, capture_session


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
def test_no_cuda_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    runner = GraphRunner(lambda x: x + 1, name="denoiser")
    with caplog.at_level(logging.INFO, logger="accel.runner"):
        for _ in range(3):
            runner(torch.zeros(1))
    said = [r for r in caplog.records if "CUDA is not available" in r.getMessage()]
    assert len(said) == 1 and said[0].getMessage().startswith("denoiser:")


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

    with pytest.raises(RuntimeError, match="boom"):
        with capture_session():
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
    from accel.bcg import _tensors as walk

    return list(walk(obj))


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
    import collections

    from accel.runner import _clone_output

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
