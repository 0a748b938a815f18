"""The patch helper (accel.graphs.patches): layered, reversible in any order, listed while in place."""

from __future__ import annotations

import os
import types

import pytest

from accel.graphs import patches
from accel.graphs.patches import MISSING, patch


class Thing:
    def greet(self) -> str:
        return "class"


def test_layers_undo_in_any_order_and_the_original_comes_back() -> None:
    ns = types.SimpleNamespace(f="original")
    a = patch(ns, "f", "a", why="first")
    b = patch(ns, "f", "b", why="second")
    assert ns.f == "b" and a.original == b.original == "original"
    a.undo()  # not the newest: the newest stays in effect
    assert ns.f == "b"
    a.undo()  # idempotent
    assert ns.f == "b" and b.in_place and not a.in_place
    b.undo()
    assert ns.f == "original"
    c = patch(ns, "f", "c", why="third")
    d = patch(ns, "f", "d", why="fourth")
    d.undo()  # the newest: the one below it comes back
    assert ns.f == "c"
    c.undo()
    assert ns.f == "original"


def test_a_missing_attribute_item_or_instance_entry_is_missing_again() -> None:
    ns = types.SimpleNamespace()
    with patch(ns, "added", 1, why="attr") as p:
        assert ns.added == 1 and p.original is MISSING
    assert not hasattr(ns, "added")

    thing = Thing()
    with patch(thing, "greet", lambda: "instance", why="shadow", where="dict"):
        assert thing.greet() == "instance"
    assert "greet" not in vars(thing) and thing.greet() == "class"

    key = "BCG_TEST_PATCH_ITEM"
    os.environ.pop(key, None)
    with patch(os.environ, key, "set", why="env", where="item"):
        assert os.environ[key] == "set"
        assert any(line == f"env: os.environ[{key!r}]" for line in patches.active())
    assert key not in os.environ


def test_active_lists_each_place_once_with_its_holders() -> None:
    ns = types.ModuleType("some_module")
    ns.helper = "stock"
    held = [patch(ns, "helper", "marked", why="helper as an eager break") for _ in range(3)]
    assert "helper as an eager break: some_module.helper (held 3 times)" in patches.active()
    for p in held:
        p.undo()
    assert not any("some_module" in line for line in patches.active())
    assert ns.helper == "stock"


def test_a_patch_is_undone_on_error_as_a_context_manager() -> None:
    ns = types.SimpleNamespace(x=1)
    with pytest.raises(RuntimeError), patch(ns, "x", 2, why="test"):
        raise RuntimeError("boom")
    assert ns.x == 1


def test_placed_is_true_only_while_the_patch_in_effect_is_what_the_place_holds() -> None:
    thing = Thing()
    assert not patches.placed(thing, "greet", "dict")
    p = patch(thing, "greet", lambda: "ours", why="form", where="dict")
    assert patches.placed(thing, "greet", "dict")
    assert not patches.placed(thing, "greet")  # another kind of place
    thing.__dict__["greet"] = lambda: "someone else's"  # written over ours
    assert not patches.placed(thing, "greet", "dict")
    p.undo()
    assert not patches.placed(thing, "greet", "dict")
