"""The breakable-graph core without CUDA: marking, strict copy-back, and break bookkeeping.

Segments cannot be captured on a CPU, so the bookkeeping tests drive a real ``accel.graphs.bcg._Capture``
whose ``open``/``close`` append dummy segments instead of CUDA graphs (``tests.helpers.fakes``). Everything else (closing a
segment at a break, running the break once, keeping its output as the boundary buffer, recording
the call, nesting rules, replay walking segments and breaks, copy-back) is the production code.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch

from accel.graphs import bcg, tree
from accel.graphs.bcg import (
    BreakableCUDAGraph,
    BreakError,
    CopyBackError,
    NestedBreakError,
    break_graph,
    eager_on_graph,
    is_capturing,
)
from accel.graphs.copyback import copy_into
from tests.helpers.fakes import DummySegment, fake_capture

# --------------------------------------------------------------------------------------------
# Outside a capture
# --------------------------------------------------------------------------------------------


def test_marked_function_is_a_plain_call_outside_capture() -> None:
    calls: list[Any] = []

    def scale(x: torch.Tensor, *, by: float = 2.0) -> torch.Tensor:
        """Multiply."""
        calls.append(x)
        return x * by

    marked = eager_on_graph(scale)
    x = torch.arange(4.0)
    out = marked(x, by=3.0)
    assert torch.equal(out, x * 3.0)
    assert len(calls) == 1 and calls[0] is x
    assert marked.__wrapped__ is scale
    assert marked.__name__ == "scale" and marked.__doc__ == "Multiply."
    assert marked.__bcg_eager__ is True

    # the very object the function returns comes back, with no copy or bookkeeping
    same = eager_on_graph(lambda obj: obj)
    payload = {"a": [x]}
    assert same(payload) is payload


def test_decorator_forms() -> None:
    @eager_on_graph
    def plain(a: int, b: int) -> int:
        return a - b

    @eager_on_graph(name="custom label")
    def named(a: int, b: int = 1) -> int:
        return a * 10 + b

    @eager_on_graph(name="inline", inline_nested=True)
    def inline(a: int) -> int:
        return a + 100

    assert plain(5, 2) == 3
    assert named(4, b=2) == 42
    assert inline(1) == 101
    assert plain.__name__ == "plain" and named.__name__ == "named"
    assert plain.__wrapped__(5, 2) == 3


def test_break_graph_and_is_capturing_outside_capture() -> None:
    assert is_capturing() is False
    assert break_graph() is None
    assert is_capturing() is False


# --------------------------------------------------------------------------------------------
# copy-back: strict, in place
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Out:
    sample: torch.Tensor
    extra: tuple
    note: str = "x"


class Plain:
    def __init__(self, h: torch.Tensor, n: int) -> None:
        self.h = h
        self.n = n


Pair = collections.namedtuple("Pair", "a b")


def test_copy_back_copies_tensors_in_place() -> None:
    dst = torch.zeros(2, 3)
    ptr = dst.data_ptr()
    src = torch.arange(6.0).reshape(2, 3)
    copy_into(tree.Flat(dst), src, "brk")
    assert torch.equal(dst, src) and dst is not src and dst.data_ptr() == ptr
    # a non-contiguous source of the same shape is copied by value
    copy_into(tree.Flat(dst), torch.arange(6.0).reshape(3, 2).t(), "brk")
    assert torch.equal(dst, torch.arange(6.0).reshape(3, 2).t())
    # the buffer itself coming back is fine and leaves it unchanged
    before = dst.clone()
    copy_into(tree.Flat(dst), dst, "brk")
    assert torch.equal(dst, before)


def test_copy_back_containers_dataclasses_and_objects() -> None:
    t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    dst = (
        t(0, 0),
        [t(0), 7, None],
        {"k": t(0, 0, 0), "s": "name"},
        Out(sample=t(0), extra=(t(0), 3)),
        Plain(t(0, 0), 5),
        Pair(t(0), 2.5),
    )
    keep = [x for x in tree.tensors(dst)]
    ptrs = [x.data_ptr() for x in keep]
    src = (
        t(1, 2),
        [t(3), 7, None],
        {"k": t(4, 5, 6), "s": "name"},
        Out(sample=t(7), extra=(t(8), 3)),
        Plain(t(9, 10), 5),
        Pair(t(11), 2.5),
    )
    copy_into(tree.Flat(dst), src, "brk")
    got = torch.cat([x.flatten() for x in tree.tensors(dst)])
    assert got.tolist() == [float(i) for i in range(1, 12)]
    # every buffer was written in place, none replaced
    assert [x.data_ptr() for x in tree.tensors(dst)] == ptrs
    assert all(a is b for a, b in zip(tree.tensors(dst), keep))


def _src_variants() -> list[tuple[str, Any, Any, str]]:
    """(id, captured buffer, replay output, field path that must be named)."""
    z = torch.zeros
    return [
        ("shape", (z(2), z(3)), (z(2), z(4)), "output[1]"),
        ("dtype", [z(2)], [z(2, dtype=torch.float16)], "output[0]"),
        ("device", {"h": z(2)}, {"h": z(2, device="meta")}, "output['h']"),
        ("length", (z(1), z(1)), (z(1),), "output"),
        ("list-length", {"xs": [z(1)]}, {"xs": [z(1), z(1)]}, "output['xs']"),
        ("dict-keys", {"a": z(1)}, {"b": z(1)}, "output"),
        ("dict-key-order", {"a": z(1), "b": z(1)}, {"b": z(1), "a": z(1)}, "output"),
        ("type-tuple-list", (z(1),), [z(1)], "output"),
        ("type-tensor-float", [z(1)], [0.0], "output[0]"),
        ("type-float-tensor", [0.0], [z(1)], "output[0]"),
        ("type-int-bool", (1,), (True,), "output[0]"),
        ("constant", (z(1), 16), (z(1), 32), "output[1]"),
        ("nested-constant", {"cfg": {"steps": 4}}, {"cfg": {"steps": 5}}, "output['cfg']['steps']"),
        ("dataclass-field", Out(z(2), (z(1), 3)), Out(z(3), (z(1), 3)), "output.sample"),
        ("dataclass-constant", Out(z(2), (z(1), 3)), Out(z(2), (z(1), 4)), "output.extra[1]"),
        ("dataclass-str", Out(z(2), ()), Out(z(2), (), note="y"), "output.note"),
        ("object-field", Plain(z(2), 1), Plain(z(2, 2), 1), "output.h"),
        ("object-constant", Plain(z(2), 1), Plain(z(2), 2), "output.n"),
        ("namedtuple-vs-tuple", Pair(z(1), 1), (z(1), 1), "output"),
    ]


@pytest.mark.parametrize("dst,src,path", [v[1:] for v in _src_variants()], ids=[v[0] for v in _src_variants()])
def test_copy_back_mismatch_raises_naming_break_and_field(dst: Any, src: Any, path: str) -> None:
    with pytest.raises(CopyBackError) as info:
        copy_into(tree.Flat(dst), src, "rope table")
    msg = str(info.value)
    assert msg.startswith(f"break 'rope table': {path}: "), msg
    assert isinstance(info.value, BreakError)


def test_copy_back_object_attribute_set_change_raises() -> None:
    a, b = Plain(torch.zeros(1), 1), Plain(torch.zeros(1), 1)
    b.more = 2
    with pytest.raises(CopyBackError, match=r"break 'brk': output: attributes changed"):
        copy_into(tree.Flat(a), b, "brk")


# --------------------------------------------------------------------------------------------
# Break bookkeeping, with dummy segments in place of CUDA graphs
# --------------------------------------------------------------------------------------------


def test_breaks_split_segments_and_replay_reruns_them(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    @eager_on_graph(name="host sum")
    def host_sum(x: torch.Tensor) -> torch.Tensor:
        events.append("host sum")
        return x.sum(dim=-1, keepdim=True)  # a fresh tensor every call

    @eager_on_graph
    def pack(s: torch.Tensor, *, scale: float) -> dict[str, Any]:
        events.append("pack")
        return {"scaled": s * scale, "pair": (s + 1, int(scale))}

    x = torch.arange(6.0).reshape(2, 3)
    with fake_capture(monkeypatch, events) as fake:
        assert is_capturing()
        s = host_sum(x)
        out = pack(s, scale=2.0)
    graph = fake.graph
    # each break ran once at capture, right after the segment before it ran for real
    assert events == ["seg0", "host sum", "seg1", "pack"]
    assert not is_capturing()

    # bookkeeping
    assert len(graph.segments) == len(graph.breaks) + 1 == 3
    assert graph.num_segments == 3
    assert graph.break_names == ["host sum", pack.__qualname__]
    assert [seg.index for seg in graph.segments] == [0, 1, 2]
    # the capture pass returned the boundary buffers themselves
    assert s is graph.breaks[0].buffer and out is graph.breaks[1].buffer
    # breaks hold their argument objects strongly (the second reads the first's boundary buffer)
    assert graph.breaks[0].args[0] is x and graph.breaks[1].args[0] is s
    assert graph.breaks[1].kwargs == {"scale": 2.0}
    assert graph.boundary_bytes() == 3 * (2 * 4)  # s, scaled, s + 1: three [2, 1] float32 tensors

    buffers = [s, out["scaled"], out["pair"][0]]
    ptrs = [t.data_ptr() for t in buffers]
    for step in range(3):
        events.clear()
        x.add_(10.0)  # what the previous segment would have written into the input's storage
        graph.replay()
        assert events == ["seg0", "host sum", "seg1", "pack", "seg2"]
        want = x.sum(dim=-1, keepdim=True)
        assert torch.equal(s, want), step
        assert torch.equal(out["scaled"], want * 2.0)
        assert torch.equal(out["pair"][0], want + 1)
        assert out["pair"][1] == 2
        assert [t.data_ptr() for t in buffers] == ptrs  # fixed addresses


def test_replay_walks_segments_and_breaks_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    @eager_on_graph(name="a")
    def a() -> None:
        events.append("a")

    @eager_on_graph(name="b")
    def b() -> None:
        events.append("b")

    with fake_capture(monkeypatch, events) as fake:
        a()
        b()
    # At capture each closed segment runs once before its break (the last one is only recorded).
    assert events == ["seg0", "a", "seg1", "b"]
    events.clear()
    fake.graph.replay()
    assert events == ["seg0", "a", "seg1", "b", "seg2"]
    fake.graph.replay()
    assert events == ["seg0", "a", "seg1", "b", "seg2"] * 2


def test_break_at_start_and_end_leaves_empty_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_capture(monkeypatch) as fake:
        break_graph()
        break_graph()
    assert fake.graph.break_names == ["break_graph", "break_graph"]
    assert len(fake.graph.segments) == 3
    assert all(b.buffer is None for b in fake.graph.breaks)
    assert fake.log == ["seg0", "seg1"]  # run at capture, before each break
    fake.log.clear()
    fake.graph.replay()
    assert fake.log == ["seg0", "seg1", "seg2"]


def test_replay_output_change_raises_copy_back_error(monkeypatch: pytest.MonkeyPatch) -> None:
    n = [3]

    @eager_on_graph(name="slice")
    def head(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x[: n[0]].clone(), n[0]

    x = torch.arange(8.0)
    with fake_capture(monkeypatch) as fake:
        head(x)
    fake.graph.replay()  # same structure: fine
    n[0] = 4
    with pytest.raises(CopyBackError, match=r"break 'slice': output\[0\]: captured \(3,\)"):
        fake.graph.replay()
    n[0] = 3
    fake.graph.breaks[0].fn = lambda x: (x[:3].clone(), 5)
    with pytest.raises(CopyBackError, match=r"break 'slice': output\[1\]: constant changed from 3 to 5"):
        fake.graph.replay()


def test_is_capturing_inside_a_break(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    @eager_on_graph
    def probe() -> None:
        seen.append(is_capturing())

    with fake_capture(monkeypatch):
        probe()
    assert seen == [True]


def test_nested_break_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    @eager_on_graph(name="inner")
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @eager_on_graph(name="outer")
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 2

    x = torch.zeros(2)
    with (
        pytest.raises(NestedBreakError, match=r"'inner'.*inside another eager break") as info,
        fake_capture(monkeypatch) as fake,
    ):
        outer(x)
    assert isinstance(info.value, BreakError)
    # the failed capture is reset, and marking works as a plain call again
    assert fake.graph.segments == [] and fake.graph.breaks == []
    assert fake.cap.in_break is False
    assert not is_capturing()
    assert torch.equal(outer(x), torch.full((2,), 2.0))


def test_inline_nested_runs_inner_marked_calls_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    inner_calls: list[bool] = []

    @eager_on_graph(name="inner")
    def inner(x: torch.Tensor) -> torch.Tensor:
        inner_calls.append(is_capturing())
        return x + 1

    @eager_on_graph(name="whole forward", inline_nested=True)
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 2

    x = torch.zeros(2)
    with fake_capture(monkeypatch) as fake:
        y = outer(x)
        assert is_capturing()  # restored after the inline break
    assert torch.equal(y, torch.full((2,), 2.0))
    assert fake.graph.break_names == ["whole forward"]  # the inner call made no break
    assert len(fake.graph.segments) == 2
    assert inner_calls == [False]
    x.fill_(4.0)
    fake.graph.replay()
    assert inner_calls == [False, False]
    assert torch.equal(y, torch.full((2,), 10.0))


def test_capture_refuses_when_already_capturing_or_graph_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        fake_capture(monkeypatch),
        pytest.raises(BreakError, match="already active"),
        bcg.capture(BreakableCUDAGraph()),
    ):
        pass
    graph = BreakableCUDAGraph()
    graph.segments.append(DummySegment(0, []))
    with pytest.raises(BreakError, match="already holds a capture"), bcg.capture(graph):
        pass
    graph.reset()
    assert graph.segments == [] and graph.breaks == []
