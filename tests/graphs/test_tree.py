"""Nested values (accel.graphs.tree): every walker of the library covers the same containers.

Each container kind is put through each walker's job: listing tensors, copying an output
(runner), copying a break's replay output back into its boundary buffer (bcg), replacing pool
tensors in a break's recorded arguments by views (bcg), and call signatures with rebuild.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers.utils import BaseOutput
from transformers.utils import ModelOutput

from accel.graphs import bcg, tree
from accel.graphs.copyback import copy_into, views_of_pool_tensors
from accel.graphs.errors import CopyBackError
from accel.graphs.signature import describe_diff, flatten
from tests.helpers.fakes import fake_capture

# --------------------------------------------------------------------------------------------
# One value per container kind: make(a, b) holds a at field "a" and b = [tensor, 3] at field "b"
# --------------------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Fields:
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class FrozenFields:
    a: Any
    b: Any
    note: str = dataclasses.field(default="late", init=False)


@dataclasses.dataclass
class DiffusersOutput(BaseOutput):
    a: Any = None
    b: Any = None


@dataclasses.dataclass
class TransformersOutput(ModelOutput):
    a: Any = None
    b: Any = None


class Plain:
    def __init__(self, a: Any, b: Any) -> None:
        self.a = a
        self.b = b


class TaggedDict(dict):
    pass


KINDS: dict[str, tuple[Callable[[Any, Any], Any], tuple[str, str, str]]] = {
    "tuple": (lambda a, b: (a, b), ("[0]", "[1][0]", "[1][1]")),
    "list": (lambda a, b: [a, b], ("[0]", "[1][0]", "[1][1]")),
    "dict": (lambda a, b: {"a": a, "b": b}, ("['a']", "['b'][0]", "['b'][1]")),
    "OrderedDict": (lambda a, b: collections.OrderedDict(a=a, b=b), ("['a']", "['b'][0]", "['b'][1]")),
    "defaultdict": (lambda a, b: collections.defaultdict(list, a=a, b=b), ("['a']", "['b'][0]", "['b'][1]")),
    "namedtuple": (lambda a, b: Pair(a, b), (".a", ".b[0]", ".b[1]")),
    "dataclass": (lambda a, b: Fields(a, b), (".a", ".b[0]", ".b[1]")),
    "frozen dataclass": (lambda a, b: FrozenFields(a, b), (".a", ".b[0]", ".b[1]")),
    "diffusers BaseOutput": (lambda a, b: DiffusersOutput(a=a, b=b), ("['a']", "['b'][0]", "['b'][1]")),
    "transformers ModelOutput": (lambda a, b: TransformersOutput(a=a, b=b), ("['a']", "['b'][0]", "['b'][1]")),
    "plain object": (lambda a, b: Plain(a, b), (".a", ".b[0]", ".b[1]")),
    "dict subclass": (lambda a, b: TaggedDict(a=a, b=b), ("['a']", "['b'][0]", "['b'][1]")),
}
# Passed on to other code, these stay leaves (matched and held by identity).
OBJECTS = {"plain object", "dict subclass"}

kinds = pytest.mark.parametrize("kind", list(KINDS))


def make(kind: str, a: Any, first: Any, second: Any = 3) -> Any:
    return KINDS[kind][0](a, [first, second])


def field(obj: Any, name: str) -> Any:
    """Field "a" or "b" of a value made by make()."""
    if isinstance(obj, dict):
        return obj[name]
    if type(obj) in (tuple, list):
        return obj["ab".index(name)]
    return getattr(obj, name)


def fresh() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(3.0), torch.arange(4.0).reshape(2, 2)


# --------------------------------------------------------------------------------------------
# Each walker's job, on each kind
# --------------------------------------------------------------------------------------------
@kinds
def test_tensors_and_leaf_paths(kind: str) -> None:
    a, b = fresh()
    value = make(kind, a, b)
    found = tree.tensors(value)
    assert len(found) == 2 and found[0] is a and found[1] is b
    leaves, spec = tree.flatten(value)
    paths = dict(zip(tree.leaf_paths(spec), leaves))
    want = KINDS[kind][1]
    assert paths[want[0]] is a and paths[want[1]] is b and paths[want[2]] == 3


@kinds
def test_clone_copies_tensors_and_rebuilds_containers(kind: str) -> None:
    a, b = fresh()
    value = make(kind, a, b)
    for copy in (tree.clone(value), tree.Flat(value).clone()):  # Flat.clone is the runner's replay copy
        assert type(copy) is type(value) and copy is not value
        assert type(field(copy, "b")) is list and field(copy, "b") is not field(value, "b")
        assert field(copy, "b")[1] == 3
        got = tree.tensors(copy)
        assert [torch.equal(x, y) for x, y in zip(got, (a, b))] == [True, True]
        assert all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in zip(got, (a, b)))
        got[0].add_(100.0)  # never aliases the source (a graph's output buffers)
        assert torch.equal(a, torch.arange(3.0))
    if kind == "frozen dataclass":
        assert tree.clone(value).note == "late"
    if kind == "defaultdict":
        assert tree.clone(value).default_factory is list


@kinds
def test_copy_back_writes_in_place_and_names_the_field(kind: str) -> None:
    a, b = torch.zeros(3), torch.zeros(2, 2)
    buffer = make(kind, a, b)
    replay = make(kind, *fresh())
    copy_into(tree.Flat(buffer), replay, "brk")
    assert field(buffer, "a") is a and field(buffer, "b")[0] is b  # the same buffers, written in place
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b, torch.arange(4.0).reshape(2, 2))
    paths = KINDS[kind][1]
    with pytest.raises(CopyBackError, match=rf"^break 'brk': output{_re(paths[2])}: constant changed from 3 to 4$"):
        copy_into(tree.Flat(buffer), make(kind, *fresh(), second=4), "brk")
    with pytest.raises(CopyBackError, match=rf"^break 'brk': output{_re(paths[1])}: captured \(2, 2\)"):
        copy_into(tree.Flat(buffer), make(kind, torch.zeros(3), torch.zeros(2)), "brk")


def _re(path: str) -> str:
    import re

    return re.escape(path)


class FakePoolMap:
    """Stands in for copyback.PoolMap: 'owns' exactly the given tensors."""

    def __init__(self, *owned: torch.Tensor) -> None:
        self.owned = owned

    def owns(self, t: torch.Tensor) -> bool:
        return any(t is o for o in self.owned)


@kinds
def test_break_arguments_get_views_of_pool_tensors(kind: str) -> None:
    a, b = fresh()
    value = make(kind, a, b)
    args, kwargs = (value, a), {"extra": value}
    new_args = views_of_pool_tensors(args, FakePoolMap(a, b))
    new_kwargs = views_of_pool_tensors(kwargs, FakePoolMap(a, b))
    assert new_args[1] is not a and new_args[1].data_ptr() == a.data_ptr()  # a view: same memory
    if kind in OBJECTS:
        # passed on by identity: the callee gets the very object (its tensors stay strongly held)
        assert new_args[0] is value and new_kwargs["extra"] is value
        return
    for rebuilt in (new_args[0], new_kwargs["extra"]):
        assert type(rebuilt) is type(value) and rebuilt is not value
        views = tree.tensors(rebuilt)
        assert len(views) == 2 and all(v is not t for v, t in zip(views, (a, b)))
        assert [v.data_ptr() for v in views] == [a.data_ptr(), b.data_ptr()]
        assert field(rebuilt, "b")[1] == 3
        a.add_(1.0)  # a view sees the producing segment's writes
        assert torch.equal(views[0], a)


def test_namedtuple_and_dataclass_arguments_no_longer_pin_pool_tensors() -> None:
    """The old walker rebuilt only exact lists, tuples and dicts: a pool tensor inside a namedtuple
    or dataclass argument stayed strongly held, pinning its pool block."""
    a, b = fresh()
    pool = FakePoolMap(a, b)
    for arg in (Pair(a, b), Fields(a, [b])):
        (out,) = views_of_pool_tensors((arg,), pool)
        assert out is not arg
        assert not any(t is a or t is b for t in tree.tensors(out))


def test_a_break_records_views_of_pool_tensors_inside_a_namedtuple_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a (CPU-faked) capture: what the break holds for replay are the views."""
    a, b = fresh()

    @bcg.eager_on_graph(name="sum pair")
    def sum_pair(pair: Pair, *, extra: Fields) -> torch.Tensor:
        return pair.a.sum() + pair.b.sum() + extra.a.sum()

    with fake_capture(monkeypatch) as fake:
        fake.cap.pool_map = FakePoolMap(a, b)
        out = sum_pair(Pair(a, b), extra=Fields(a, None))
    graph = fake.graph
    (brk,) = graph.breaks
    held = tree.tensors((brk.args, brk.kwargs))
    assert len(held) == 3 and not any(t is a or t is b for t in held)
    assert type(brk.args[0]) is Pair and type(brk.kwargs["extra"]) is Fields
    a.fill_(10.0)  # what the producing segment would write before the break reads it
    graph.replay()
    assert out.item() == 30.0 + 6.0 + 30.0


def test_a_type_torch_declares_opaque_is_a_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class Opaque:
        x: torch.Tensor

    import torch._library.opaque_object as opaque_object

    real = opaque_object.is_opaque_type
    monkeypatch.setattr(opaque_object, "is_opaque_type", lambda cls: cls is Opaque or real(cls))
    value = Opaque(torch.zeros(1))
    assert tree.flatten([value])[0] == [value]
    assert tree.clone([value])[0] is value


def test_dataclasses_and_objects_stay_out_of_torchs_registry() -> None:
    @dataclasses.dataclass
    class Mine:
        x: torch.Tensor

    class Holder:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    before = dict(torch.utils._pytree.SUPPORTED_NODES)
    value = [Mine(torch.ones(1)), Holder(torch.ones(2))]
    copy = tree.clone(value)
    assert type(copy[0]) is Mine and type(copy[1]) is Holder and copy[0].x is not value[0].x
    assert dict(torch.utils._pytree.SUPPORTED_NODES) == before
    # so torch's own pytree still sees them as leaves, as it would without this library
    assert torch.utils._pytree.tree_leaves(value) == value


def test_arguments_without_pool_tensors_come_back_unchanged() -> None:
    a, b = fresh()
    args = (Pair(a, 1), [b], {"k": Fields(a, b)})
    assert views_of_pool_tensors(args, FakePoolMap()) is args
    assert views_of_pool_tensors(args, FakePoolMap(torch.zeros(1))) is args


@kinds
def test_signatures_key_and_rebuild(kind: str) -> None:
    a, b = fresh()
    value = make(kind, a, b)
    sig, leaves = flatten((value,), {"k": value})
    same, _ = flatten((make(kind, a + 1, b * 2),), {"k": make(kind, a + 1, b * 2)})
    hash(sig.key)
    if kind in OBJECTS:
        assert leaves == [] and sig.objects == (value, value)
        assert same.key != sig.key  # another object: another graph
        (arg,), kwargs = sig.rebuild([])
        assert arg is value and kwargs["k"] is value
        return
    assert len(leaves) == 4 and leaves[0] is a and leaves[1] is b
    assert same.key == sig.key  # tensor values do not matter
    assert flatten((make(kind, a, b, second=4),), {"k": value})[0].key != sig.key  # constants do
    assert flatten((make(kind, a, b.float()[0]),), {"k": value})[0].key != sig.key  # shapes do
    new = [torch.full_like(t, 7.0) for t in leaves]
    (arg,), kwargs = sig.rebuild(new)
    assert type(arg) is type(value) and type(kwargs["k"]) is type(value)
    assert field(arg, "a") is new[0] and field(arg, "b")[0] is new[1] and field(arg, "b")[1] == 3
    assert flatten((arg,), kwargs)[0].key == sig.key


@pytest.mark.parametrize("other", ["tuple", "list", "namedtuple", "dataclass", "dict"])
def test_container_kinds_never_share_a_signature(other: str) -> None:
    a, b = fresh()
    keys = {kind: flatten((make(kind, a, b),), {})[0].key for kind in KINDS if kind not in OBJECTS}
    assert list(keys.values()).count(keys[other]) == 1


def test_signature_describes_differences_inside_containers() -> None:
    a, b = fresh()
    call = flatten((Pair(a, [b, 3]),), {"out": Fields(a, [b, 4])})[0]
    captured = flatten((Pair(a[:2], [b, 3]),), {"out": Fields(a, [b, 5])})[0]
    assert describe_diff(call, captured) == [
        "args[0].a: tensor[3] float32 on cpu vs tensor[2] float32 on cpu",
        "out.b[1]: 4 vs 5",
    ]
    other = flatten((Pair(a, [b, 3]),), {"out": (a, [b, 4])})[0]
    assert describe_diff(other, call) == ["out: tuple of 2 vs Fields with fields ['a', 'b']"]


# --------------------------------------------------------------------------------------------
# What is a container and what is a leaf
# --------------------------------------------------------------------------------------------
class Color(enum.Enum):
    RED = 1


def test_leaves_in_both_views() -> None:
    module = torch.nn.Linear(1, 1)
    size = torch.Size([2, 3])
    values = [torch.zeros(1), module, len, Color.RED, torch.float16, torch.device("cpu"), size, "s", None, 1.5, Plain]
    for into_objects in (True, False):
        leaves, _spec = tree.flatten(values, into_objects=into_objects)
        assert len(leaves) == len(values) and all(x is y for x, y in zip(leaves, values))
    assert tree.clone([module, size])[0] is module


def test_plain_objects_are_opened_only_in_the_values_view() -> None:
    obj = Plain(torch.zeros(1), "tag")
    assert tree.flatten(obj, into_objects=False)[0] == [obj]
    leaves, spec = tree.flatten(obj)
    assert leaves[1] == "tag" and tree.leaf_paths(spec) == [".a", ".b"]
    obj.c = 1  # attributes are structure: another set, another spec
    assert tree.spec_key(tree.flatten(obj)[1]) != tree.spec_key(spec)


def test_a_dataclass_field_that_was_never_set_is_not_structure() -> None:
    @dataclasses.dataclass
    class Late:
        x: torch.Tensor
        derived: Any = dataclasses.field(init=False)

    value = Late(torch.zeros(1))
    assert tree.leaf_paths(tree.flatten(value)[1]) == [".x"]
    value.derived = torch.ones(1)
    copy = tree.clone(value)
    assert torch.equal(copy.derived, torch.ones(1)) and copy.derived is not value.derived


def test_spec_keys_are_hashable_and_exact() -> None:
    a = torch.zeros(1)
    k1 = tree.spec_key(tree.flatten({"x": a, "y": [a]})[1])
    assert k1 == tree.spec_key(tree.flatten({"x": 0, "y": [1]})[1])
    assert k1 != tree.spec_key(tree.flatten({"y": [a], "x": a})[1])  # key order is structure
    assert len({k1, tree.spec_key(tree.flatten({"x": a, "y": (a,)})[1])}) == 2


def test_align_pairs_leaves_and_reports_the_highest_difference() -> None:
    _, a = tree.flatten({"x": (1, 2), "y": [1]})
    _, b = tree.flatten({"x": (1, 2), "y": [1, 2]})
    steps = list(tree.align(a, b, "out"))
    assert [(s.path, s.leaves) for s in steps] == [("out['x'][0]", True), ("out['x'][1]", True), ("out['y']", False)]
    assert tree.describe_change(steps[-1].a, steps[-1].b) == "length changed from 1 to 2"
