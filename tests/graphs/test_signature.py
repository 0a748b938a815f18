"""Call signatures: which calls may share a captured graph, and how a miss is explained."""

from __future__ import annotations

import enum

import pytest
import torch
from torch import nn

from accel.graphs.signature import describe_diff, flatten


def key(*args, **kwargs):
    return flatten(args, kwargs)[0].key


def sig(*args, **kwargs):
    return flatten(args, kwargs)[0]


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def _call(x=None, t=None, **over):
    x = torch.zeros(2, 3) if x is None else x
    t = torch.zeros(2) if t is None else t
    kwargs = dict(hidden_states=x, timestep=t, attention_kwargs={"scale": 1.0}, txt_seq_lens=[7, 9], return_dict=False)
    kwargs.update(over)
    return kwargs


def test_equal_calls_have_equal_keys_whatever_the_tensor_values() -> None:
    a = key(torch.zeros(2, 3), 4, mode="x", extra=[torch.ones(1), {"s": 1.5}])
    b = key(torch.randn(2, 3), 4, mode="x", extra=[torch.full((1,), 7.0), {"s": 1.5}])
    assert a == b
    assert hash(a) == hash(b)


def test_keyword_order_does_not_matter() -> None:
    x = torch.zeros(2)
    assert key(a=x, b=1) == key(b=1, a=x)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: ((torch.zeros(2, 4),), {}), id="shape"),
        pytest.param(lambda: ((torch.zeros(2, 3, dtype=torch.float64),), {}), id="dtype"),
        pytest.param(lambda: ((torch.zeros(2, 3, device="meta"),), {}), id="device"),
        pytest.param(lambda: ((torch.zeros(2, 3), 1), {}), id="extra-arg"),
        pytest.param(lambda: ((torch.zeros(2, 3),), {"k": 1}), id="extra-kwarg"),
    ],
)
def test_changes_give_different_keys(other) -> None:
    base = key(torch.zeros(2, 3))
    args, kwargs = other()
    assert key(*args, **kwargs) != base


def test_structure_and_constant_changes_give_different_keys() -> None:
    base = key(**_call())
    assert key(**_call(txt_seq_lens=[7, 10])) != base  # constant in a list
    assert key(**_call(txt_seq_lens=(7, 9))) != base  # list -> tuple
    assert key([torch.zeros(1)]) != key((torch.zeros(1),))
    assert key(**_call(txt_seq_lens=[7, 9, 1])) != base  # length
    assert key(**_call(attention_kwargs={"scale": 2.0})) != base  # constant in a dict
    assert key(**_call(attention_kwargs={"gain": 1.0})) != base  # dict keys
    assert key(**_call(attention_kwargs={"scale": 1.0, "b": 0})) != base  # dict size
    assert key(**_call(return_dict=True)) != base
    assert key(**_call(mode="a")) != key(**_call(mode="b"))
    assert key(**_call(mode=None)) != key(**_call(mode=0))
    assert key(Color.RED) != key(Color.BLUE)
    assert key(torch.float16) != key(torch.bfloat16)


def test_dict_key_order_is_part_of_the_structure() -> None:
    assert key({"a": 1, "b": 2}) != key({"b": 2, "a": 1})


def test_bool_int_and_float_constants_are_distinct() -> None:
    keys = {key(True), key(1), key(1.0)}
    assert len(keys) == 3
    assert key(False) != key(0)
    assert key(0) != key(0.0)
    # also nested, where container equality would otherwise conflate them
    assert key([1]) != key([True])
    assert key({"s": 1}) != key({"s": 1.0})


def test_tensor_leaves_come_out_in_a_fixed_order() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    _, leaves = flatten((a, [b, {"z": c}]), {"y": d})
    assert [t is u for t, u in zip(leaves, (a, b, c, d))] == [True] * 4
    # keyword arguments are ordered by name, whatever order they were passed in
    _, leaves = flatten((), {"b": b, "a": a})
    assert leaves[0] is a and leaves[1] is b


def test_rebuild_reproduces_the_structure_with_new_tensors_in_order() -> None:
    mod = nn.Identity()
    args = (torch.zeros(2), [torch.zeros(3), (4, "s")], {"k": torch.zeros(1), "none": None})
    kwargs = {"timestep": torch.zeros(5), "module": mod, "opts": {"scale": 0.5, "flag": True}}
    s, leaves = flatten(args, kwargs)
    new = [torch.full_like(t, float(i + 1)) for i, t in enumerate(leaves)]
    r_args, r_kwargs = s.rebuild(new)

    assert type(r_args) is tuple and len(r_args) == 3
    assert r_args[0] is new[0]
    assert type(r_args[1]) is list and r_args[1][0] is new[1]
    assert r_args[1][1] == (4, "s") and type(r_args[1][1]) is tuple
    assert list(r_args[2]) == ["k", "none"] and r_args[2]["k"] is new[2] and r_args[2]["none"] is None
    assert set(r_kwargs) == {"timestep", "module", "opts"}
    assert r_kwargs["timestep"] is new[3]
    assert r_kwargs["module"] is mod
    assert r_kwargs["opts"] == {"scale": 0.5, "flag": True}
    assert type(r_kwargs["opts"]["flag"]) is bool
    # the rebuilt call has the same signature as the original
    assert flatten(r_args, r_kwargs)[0].key == s.key


def test_identity_matched_objects_are_held_strongly_and_matched_by_identity() -> None:
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    s1 = sig(torch.zeros(1), m1)
    assert s1.objects == (m1,) and s1.objects[0] is m1
    assert sig(torch.zeros(1), m1).key == s1.key
    # an equal-looking but different object is a different signature
    assert sig(torch.zeros(1), m2).key != s1.key
    # the signature keeps the object alive, so its id cannot be reused by another object
    import gc
    import weakref

    m3 = nn.Linear(2, 2)
    ref = weakref.ref(m3)
    s3 = sig(m3)
    del m3
    gc.collect()
    assert ref() is not None and s3.objects[0] is ref()


def test_describe_diff_names_the_differing_fields() -> None:
    captured = sig(torch.zeros(2, 3), 4, **_call())
    call = sig(
        torch.zeros(2, 3),
        5,
        **_call(x=torch.zeros(2, 8), attention_kwargs={"scale": 2.0}, txt_seq_lens=[7, 11]),
    )
    diffs = describe_diff(call, captured)
    text = "\n".join(diffs)
    assert len(diffs) == 4, diffs
    assert any(d.startswith("hidden_states:") and "[2, 8]" in d and "[2, 3]" in d for d in diffs), text
    assert any(d.startswith("args[1]:") and "5" in d and "4" in d for d in diffs), text
    assert any(d.startswith("attention_kwargs['scale']:") and "2.0" in d for d in diffs), text
    assert any(d.startswith("txt_seq_lens[1]:") and "11" in d and "9" in d for d in diffs), text
    # fields that agree are not named
    assert "timestep" not in text and "return_dict" not in text


def test_describe_diff_dtype_device_keys_and_lengths() -> None:
    base = sig(torch.zeros(2), a=[1, 2], d={"x": 1})
    diffs = describe_diff(sig(torch.zeros(2, dtype=torch.float16), a=[1, 2], d={"x": 1}), base)
    assert len(diffs) == 1 and diffs[0].startswith("args[0]:") and "float16" in diffs[0]
    diffs = describe_diff(sig(torch.zeros(2, device="meta"), a=[1, 2], d={"x": 1}), base)
    assert len(diffs) == 1 and diffs[0].startswith("args[0]:") and "meta" in diffs[0]
    diffs = describe_diff(sig(torch.zeros(2), a=[1, 2, 3], d={"x": 1}), base)
    assert len(diffs) == 1 and diffs[0].startswith("a:") and "list of 3" in diffs[0]
    diffs = describe_diff(sig(torch.zeros(2), a=[1, 2], d={"y": 1}), base)
    assert len(diffs) == 1 and diffs[0].startswith("d:") and "x" in diffs[0] and "y" in diffs[0]
    diffs = describe_diff(sig(torch.zeros(2), a=[1, 2], d={"x": 1}, new=1), base)
    assert len(diffs) == 1 and diffs[0].startswith("kwargs:") and "new" in diffs[0]
    diffs = describe_diff(sig(torch.zeros(2), a=[True, 2], d={"x": 1}), base)
    assert diffs == ["a[0]: True vs 1"]
    assert describe_diff(base, sig(torch.ones(2), a=[1, 2], d={"x": 1})) == []


def test_slices_are_matched_by_their_bounds() -> None:
    s = sig(torch.zeros(1), write=slice(0, 7))
    assert sig(torch.zeros(1), write=slice(0, 7)).key == s.key and s.objects == ()
    other = sig(torch.zeros(1), write=slice(0, 8))
    assert describe_diff(other, s) == ["write: slice(0, 8, None) vs slice(0, 7, None)"]
    assert s.rebuild([torch.ones(1)])[1]["write"] == slice(0, 7)
