"""How the watch (:mod:`accel.hooks.state.watch`) keeps and compares one value: by its kind, a hook
dictionary by what its hooks compute, an attribute by what its class gives.

Values in a watched ``__dict__`` are of three kinds (:func:`kind`): *plain* (numbers, strings,
bools, None, dtypes, devices, enums, classes, tuples), compared by value; *containers* (dicts,
lists, sets and their subclasses), compared by their shallow content, since PEFT keeps its scales,
merged adapters, DoRA switches and active adapters in them and IP-Adapter processors keep scales
in lists; and *objects*, compared by identity.

Hook dictionaries are compared by what their hooks compute, in order (:func:`hook_keys`), not by
the hooks' identities or handle numbers: a Python function by its code, the contents of its
closure cells and its defaults (each by the rule above), a bound method by its object and its
function. A hook a caller registers around every call and removes after (a pipeline's
``register_forward_hook(lambda module, args, output: args[0])`` around each encode) is a new
function object with a new handle each time, yet the same hook: each registration finds the state
it had the time before, and its graphs. A hook of other code or other captured values, one added
and left, one removed, is a change as before. Other callables (a ``functools.partial``, an object
with ``__call__``) are compared by identity; the flags torch keeps beside a hook's handle
(``with_kwargs``, ``always_called``) are not compared: they follow the hook's calling convention,
which its code fixes.

An attribute of an object's own that holds the plain value its class gives (a class attribute
along its MRO) is the same state as no attribute at all: reading it gives the same either way
(:func:`as_class_gives`). diffusers' ``reset_attention_backend`` leaves every processor an
``_attention_backend = None`` of its own beside the class's ``None``; without this, switching a
backend and back would be a third state, captured again, instead of the first one, replayed.

Which entries of which objects are watched, and what is skipped, is
:mod:`accel.hooks.state.watch_rule`.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "CONTAINER",
    "OBJECT",
    "PLAIN",
    "Same",
    "as_class_gives",
    "by_identity",
    "class_value",
    "comparable",
    "contents",
    "copy",
    "hook_key",
    "hook_keys",
    "kind",
    "same",
    "same_hooks",
    "show",
]

PLAIN = "plain"
CONTAINER = "container"
OBJECT = "object"

_PLAIN_TYPES = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, type)


def kind(v: Any) -> str:
    """``v``'s kind, which says how it compares: :data:`PLAIN`, :data:`CONTAINER` or :data:`OBJECT`."""
    if isinstance(v, (dict, list, set)):
        return CONTAINER
    if isinstance(v, _PLAIN_TYPES) or type(v) is tuple or isinstance(v, torch.Size):
        return PLAIN
    return OBJECT


def by_identity(v: Any) -> bool:
    """Whether ``v`` must be compared by identity beyond ``==``: an object whose class compares
    by value, where ``==`` could call two different objects equal (a one-element tensor; a tensor
    of more elements makes ``==`` raise, which counts as a change)."""
    if kind(v) != OBJECT:
        return False
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return type(v).__eq__ is not object.__eq__


def contents(c: Any) -> Iterable[Any]:
    """What a container holds: a dict's values, the items of any other."""
    return c.values() if isinstance(c, dict) else c


def copy(v: Any) -> Any:
    """``v`` as the snapshot keeps it: containers as shallow copies, anything else itself."""
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, set):
        return set(v)
    return v


class Same:
    """Compares equal only to a :class:`Same` of the very same object (and keeps it alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def comparable(v: Any) -> Any:
    """``v`` as the watch compares it, comparable with ``==``: plain values as they are, containers
    by their content, objects (and a set's items) by identity (:class:`Same`)."""
    k = kind(v)
    if k == PLAIN:
        return v
    if k == CONTAINER:
        if isinstance(v, dict):
            return {key: comparable(x) for key, x in v.items()}
        items = [comparable(x) for x in v]
        return items if isinstance(v, list) else ("set", frozenset(Same(x) for x in v))
    return Same(v)


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` as the watch compares them (plain by value, containers by content,
    objects by identity)."""
    if a is b:
        return True
    try:
        return comparable(a) == comparable(b)
    except Exception:  # a value whose == raises: not the same
        return False


_EMPTY_CELL = object()


def _cell(cell: Any) -> Any:
    try:
        return comparable(cell.cell_contents)
    except ValueError:  # a cell not yet filled
        return Same(_EMPTY_CELL)


def hook_key(fn: Any) -> Any:
    """What a hook computes, comparable with ``==`` (see the module docstring): a function by its
    code, closure contents and defaults; a bound method by its object and function; any other
    callable by identity."""
    if isinstance(fn, types.MethodType):
        return ("method", Same(fn.__self__), hook_key(fn.__func__))
    if isinstance(fn, types.FunctionType):
        return (
            "function",
            Same(fn.__code__),
            Same(fn.__globals__),
            tuple(_cell(c) for c in fn.__closure__ or ()),
            comparable(list(fn.__defaults__ or ())),
            comparable(dict(fn.__kwdefaults__ or {})),
        )
    return Same(fn)


def hook_keys(hooks: Any) -> Any:
    """A hook dictionary by what its hooks compute, in the order they run (handle numbers left
    out); a value that is no dictionary as the rule compares any other."""
    if not isinstance(hooks, dict):
        return comparable(hooks)
    return tuple(hook_key(fn) for fn in hooks.values())


def same_hooks(a: Any, b: Any) -> bool:
    """Two hook dictionaries as the watch compares them (:func:`hook_keys`)."""
    try:
        return bool(hook_keys(a) == hook_keys(b))
    except Exception:  # a closure value whose == raises: not the same
        return False


_ABSENT = object()


def class_value(obj: Any, key: str) -> Any:
    """The plain value ``obj``'s class gives ``key`` where ``obj`` has no attribute of its own
    (a class attribute found along the MRO), or ``_ABSENT`` (none, or not a plain value: a
    method, a property)."""
    for c in type(obj).__mro__:
        if key in c.__dict__:
            v = c.__dict__[key]
            return v if kind(v) == PLAIN else _ABSENT
    return _ABSENT


def as_class_gives(obj: Any, key: str, v: Any) -> bool:
    """Whether ``obj``'s own ``key`` holds the plain value its class gives anyway: reading the
    attribute gives the same with or without it, so it is the same state as its absence
    (diffusers' ``reset_attention_backend`` leaves ``processor._attention_backend = None``
    where before there was only the class's ``None``)."""
    if kind(v) != PLAIN:
        return False
    given = class_value(obj, key)
    return given is not _ABSENT and same(v, given)


def show(v: Any) -> str:
    """``v`` in a change's phrase: an object by its type (a function by its name), anything else
    by its repr, at most 60 characters."""
    k = kind(v)
    if k == OBJECT:
        text = getattr(v, "__qualname__", None) if callable(v) and not hasattr(v, "__dict__") else None
        text = text or type(v).__name__
    else:
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
