"""What :mod:`accel.graphs.tree` opens, and how: torch's pytree registry, read only, and a registry of its own.

Containers torch's registry holds (tuple, list, dict, namedtuple, ``BaseOutput``, ...) are walked
with torch's functions. Dataclasses and plain objects are walked with functions this module
keeps in a table of its own: it never writes to torch's registry, so it changes nothing about
how ``torch.compile``, ``torch.export`` or ``torch.utils._pytree`` treat a user's types.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

__all__ = [
    "ALWAYS_LEAF",
    "BY_REGISTRY",
    "DATACLASS",
    "NAMEDTUPLE",
    "OBJECT",
    "Node",
    "holds_hidden_tensors",
    "kind",
    "node",
    "ours",
]

# How instances of a type are walked, decided on first sight of the type.
BY_REGISTRY = "by torch's registry"  # a container if torch's registry holds it (now or later), else a leaf
NAMEDTUPLE = "namedtuple"  # walked by torch's function for collections.namedtuple, as pytree does
ALWAYS_LEAF = "always a leaf"
OBJECT = "plain object"  # a container in the values view, a leaf in the arguments view
DATACLASS = "dataclass"  # a container in both views


class Node(NamedTuple):
    """How a container type is taken apart and put back (torch's ``NodeDef`` has the same two)."""

    flatten_fn: Callable[[Any], tuple[list[Any], Any]]
    unflatten_fn: Callable[[Any, Any], Any]


KINDS: dict[type, str] = {}  # the kind of every type seen, for hot paths to read directly
_ours: dict[type, tuple[str, Node]] = {}  # dataclasses and plain objects: (DATACLASS or OBJECT, functions)
_lock = threading.Lock()
_REBUILDABLE_NEW = (object.__new__, dict.__new__, types.SimpleNamespace.__new__)

_is_namedtuple_class: Callable[[type], bool] = getattr(
    pytree,
    "is_namedtuple_class",
    lambda cls: issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple),
)


def _is_opaque(cls: type) -> bool:
    """Whether torch declares ``cls`` an opaque type (which must stay a pytree leaf)."""
    try:
        from torch._library.opaque_object import is_opaque_type
    except ImportError:  # an older torch has no opaque types
        return False
    try:
        return bool(is_opaque_type(cls))
    except Exception:
        return False


def _classify(value: Any) -> str:
    cls = type(value)
    if cls is torch.Size:
        return ALWAYS_LEAF  # recent torch registers it as a node, older releases do not: a value either way
    if _is_namedtuple_class(cls):
        return NAMEDTUPLE
    if cls in pytree.SUPPORTED_NODES or isinstance(value, (torch.Tensor, torch.nn.Module, enum.Enum, type)):
        return BY_REGISTRY
    if _is_opaque(cls):
        return ALWAYS_LEAF
    if dataclasses.is_dataclass(cls):
        _add(cls, DATACLASS)
        return DATACLASS
    if hasattr(value, "__dict__") and not callable(value) and cls.__new__ in _REBUILDABLE_NEW and not _slots(cls):
        return OBJECT  # its functions are made when first opened: the arguments view never needs them
    return BY_REGISTRY


def _slots(cls: type) -> tuple[str, ...]:
    """The slots of ``cls`` and its bases that hold state (``__dict__`` and ``__weakref__`` do not):
    an object with them is not rebuilt from its ``__dict__`` alone."""
    names: list[str] = []
    for base in cls.__mro__:
        declared = base.__dict__.get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def holds_hidden_tensors(value: Any, depth: int = 4) -> bool:
    """Whether ``value``, a leaf that is no container, holds a tensor in its ``__dict__`` or slots
    (through lists, tuples, dicts and objects like it, ``depth`` levels down).

    Modules, callables, classes and torch's opaque types are not looked into: their tensors are
    weights and what they were built with, which other checks follow.
    """
    if isinstance(value, torch.Tensor):
        return True
    if depth < 0 or isinstance(value, (torch.nn.Module, type, str, bytes)) or callable(value):
        return False
    if isinstance(value, dict):
        return any(holds_hidden_tensors(v, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_hidden_tensors(v, depth - 1) for v in value)
    cls = type(value)
    held = list(getattr(value, "__dict__", {}).values())
    held += [getattr(value, n) for n in _slots(cls) if hasattr(value, n)]
    if not held or _is_opaque(cls):
        return False
    return any(holds_hidden_tensors(v, depth - 1) for v in held)


def kind(value: Any) -> str:
    """How ``value`` is walked (one of this module's kinds), decided once per type."""
    cls = type(value)
    found = KINDS.get(cls)
    if found is None:
        found = KINDS[cls] = _classify(value)
    return found


def node(node_type: Any) -> Any:
    """The functions (``flatten_fn``, ``unflatten_fn``) of a container type: ours for dataclasses
    and plain objects, else torch's ``NodeDef``; None for a type that is no container."""
    entry = _ours.get(node_type)
    if entry is not None:
        return entry[1]
    found = pytree.SUPPORTED_NODES.get(node_type)
    if found is not None:
        return found
    if KINDS.get(node_type) is OBJECT:
        return _add(node_type, OBJECT)
    return None


def ours(node_type: Any) -> str | None:
    """DATACLASS or OBJECT for a type this module walks with its own functions, else None."""
    entry = _ours.get(node_type)
    return entry[0] if entry is not None else None


def _add(cls: type, how: str) -> Node:
    with _lock:
        entry = _ours.get(cls)
        if entry is None:
            made = (
                _dataclass_node(cls)
                if how is DATACLASS
                else Node(_object_flatten, functools.partial(_object_unflatten, cls))
            )
            entry = _ours[cls] = (how, made)
        return entry[1]


# --------------------------------------------------------------------------------------------
# Dataclasses: every field that is set; rebuilt through the constructor
# --------------------------------------------------------------------------------------------
_UNSET = object()


def _dataclass_node(cls: type) -> Node:
    """Fields with ``init=False`` are set after the constructor ran (as ``dataclasses.replace`` does)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    init = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    def flatten_fn(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        values = [getattr(obj, n, _UNSET) for n in names]
        if any(v is _UNSET for v in values):  # an init=False field without a default, never set
            present = tuple(n for n, v in zip(names, values) if v is not _UNSET)
            return [v for v in values if v is not _UNSET], present
        return values, names

    def unflatten_fn(values: Any, present: tuple[str, ...]) -> Any:
        fields = dict(zip(present, values))
        obj = cls(**{n: v for n, v in fields.items() if n in init})
        for n, v in fields.items():
            if n not in init:
                object.__setattr__(obj, n, v)  # also works on frozen dataclasses
        return obj

    return Node(flatten_fn, unflatten_fn)


# --------------------------------------------------------------------------------------------
# Plain objects: attributes sorted by name (a dict subclass's items first); rebuilt like copy.copy
# --------------------------------------------------------------------------------------------
def _object_flatten(obj: Any) -> tuple[list[Any], tuple[tuple[Any, ...] | None, tuple[str, ...]]]:
    keys = list(dict.keys(obj)) if isinstance(obj, dict) else []
    names = sorted(vars(obj), key=str)
    values = [dict.__getitem__(obj, k) for k in keys] + [vars(obj)[n] for n in names]
    return values, (tuple(keys) if isinstance(obj, dict) else None, tuple(names))


def _object_unflatten(cls: type, values: Any, context: tuple[tuple[Any, ...] | None, tuple[str, ...]]) -> Any:
    keys, names = context
    values = list(values)
    obj = cls.__new__(cls)
    if keys is not None:
        dict.update(obj, zip(keys, values[: len(keys)]))
        values = values[len(keys) :]
    obj.__dict__.update(zip(names, values))
    return obj
