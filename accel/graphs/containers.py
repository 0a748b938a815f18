"""The containers a call is given, found through its arguments, and what each holds.

A given container is a list, dict or deque in a call's arguments, a field of a dataclass there,
or an attribute of its request-scoped state (objects of the runner's ``state_types`` and every
plain object they hold), at any depth the call signature opens. Taken before a run,
:class:`Given` tells which of them the run changed; :mod:`accel.graphs.stores` records and puts
back what it stored (its docstring holds the whole contract).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import nodes
from .errors import BreakError

__all__ = ["Given", "Path", "Step", "attributes_of", "given_twice", "has_attributes", "label"]

Step = tuple[str, Any]  # ("index", i), ("key", k) or ("attr", name)
Path = tuple[Step, ...]  # from the call's root (args, kwargs): its first step is index 0 or 1
_UNSET = object()


def label(path: Path) -> str:
    """``args[1]['a']``, ``kwargs['feat_cache'][3]``: the field a path leads to."""
    (_, root), *rest = path
    text = "args" if root == 0 else "kwargs"
    for how, what in rest:
        text += f".{what}" if how == "attr" else f"[{what!r}]"
    return text


def _opened(node: Any, state: bool) -> bool:
    """Whether the call signature walks into ``node`` (``state``: request-scoped state holds it,
    or is it: plain objects are opened too)."""
    kind = nodes.kind(node)
    if kind is nodes.NAMEDTUPLE or kind is nodes.DATACLASS or (kind is nodes.OBJECT and state):
        return True
    return kind is nodes.BY_REGISTRY and type(node) in pytree.SUPPORTED_NODES


def has_attributes(node: Any) -> bool:
    """A container whose contents are attributes: a dataclass (its fields) or a plain object (its ``__dict__``)."""
    kind = nodes.kind(node)
    return kind is nodes.DATACLASS or kind is nodes.OBJECT


def attributes_of(node: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what ``node`` holds as attributes now: a dataclass's fields that are set, else its ``__dict__``."""
    if nodes.kind(node) is nodes.DATACLASS:
        present = ((f.name, getattr(node, f.name, _UNSET)) for f in dataclasses.fields(node))
        return [(n, v) for n, v in present if v is not _UNSET]
    return list(vars(node).items())


def _children(node: Any) -> list[tuple[Step, Any]]:
    if has_attributes(node):
        items = [(("key", k), v) for k, v in dict.items(node)] if isinstance(node, dict) else []
        return items + [(("attr", n), v) for n, v in attributes_of(node)]
    if isinstance(node, dict):
        return [(("key", k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple, collections.deque)):
        return [(("index", i), v) for i, v in enumerate(node)]
    return []  # another registered container: nothing of it can be stored into


def _mutable(node: Any) -> bool:
    return isinstance(node, (list, dict, collections.deque)) or has_attributes(node)


def _find(node: Any, path: Path, out: list[tuple[Path, Any]], types: frozenset[type], state: bool = False) -> None:
    if isinstance(node, torch.Tensor):
        return
    state = state or type(node) in types
    if not _opened(node, state):
        return
    if _mutable(node):
        out.append((path, node))
    for step, child in _children(node):
        _find(child, (*path, step), out, types, state)


def _contents(container: Any) -> tuple[Any, ...]:
    """What a container holds now, as a flat tuple of the objects themselves (a dict's keys or an
    object's attribute names, then the values), compared by identity."""
    if has_attributes(container):
        items = attributes_of(container)
        if isinstance(container, dict):  # a dict subclass with attributes: its items count too
            items = list(dict.items(container)) + items
        return (*(n for n, _ in items), *(v for _, v in items))
    if isinstance(container, dict):
        return (*container.keys(), *container.values())
    if isinstance(container, (list, collections.deque)):
        return tuple(container)
    return tuple(v for _, v in _children(container))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Given:
    """The containers one call is given, and what each held when it was taken.

    The objects held are referenced strongly, so no identity is reused while it is compared.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], state: frozenset[type] = frozenset()) -> None:
        self.found: list[tuple[Path, Any]] = []
        _find((args, kwargs), (), self.found, state)
        self.held = [_contents(c) for _, c in self.found]

    def changed(self) -> list[tuple[Path, Any, tuple[Any, ...]]]:
        """(path, container, contents now) of every container whose contents changed."""
        out = []
        for (path, c), before in zip(self.found, self.held):
            now = _contents(c)
            if not _same(before, now):
                out.append((path, c, now))
        return out

    @contextlib.contextmanager
    def unchanged_by(self, what: str) -> Iterator[None]:
        """Raise BreakError if the block (an eager break's run) stores into a given container."""
        before = [_contents(c) for _, c in self.found]
        yield
        for (path, c), was in zip(self.found, before):
            if not _same(was, _contents(c)):
                raise BreakError(
                    f"{what} stores into {label(path)}, a container given to the call: a replay runs the break "
                    "on the capture's containers, not the caller's"
                )


def given_twice(args: tuple[Any, ...], kwargs: dict[str, Any], state: frozenset[type] = frozenset()) -> str | None:
    """The field of a container given a second time in one call (the first found), else None."""
    found: list[tuple[Path, Any]] = []
    _find((args, kwargs), (), found, state)
    seen: set[int] = set()
    for path, c in found:
        if id(c) in seen:
            return label(path)
        seen.add(id(c))
    return None
