"""Call signatures: what must match for a captured graph to serve a call.

A signature is the call's structure (positional and keyword arguments, nested lists, tuples and
dicts), the (shape, dtype, device) of every tensor leaf, and the value of every literal constant.
Two calls with equal signatures can share one graph: tensor values are copied into static
buffers, everything else was baked into the graph at capture.

Objects that are neither tensors, containers nor literals (a module, a callback) are matched by
identity, so a graph never serves a call with a different object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Hashable

import torch

__all__ = ["Signature", "flatten", "describe_diff"]

_LITERALS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


@dataclass(frozen=True)
class Signature:
    """A hashable call signature plus what is needed to rebuild the call around new tensors.

    ``key`` is the hashable description; ``objects`` holds the identity-matched objects strongly
    (a graph baked them in), in the order :meth:`rebuild` consumes them.
    """

    key: Hashable
    objects: tuple[Any, ...]

    def rebuild(self, leaves: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from this signature with ``leaves`` as the tensors."""
        tensors = iter(leaves)
        objects = iter(self.objects)

        def build(node: tuple) -> Any:
            kind = node[0]
            if kind == "T":
                return next(tensors)
            if kind == "C":
                return node[2]
            if kind == "O":
                return next(objects)
            if kind == "L":
                return [build(c) for c in node[1]]
            if kind == "U":
                return tuple(build(c) for c in node[1])
            if kind == "D":
                return {k: build(c) for k, c in zip(node[1], node[2])}
            raise AssertionError(f"unknown signature node {kind!r}")

        args_node, kwargs_node = self.key  # type: ignore[misc]
        return build(args_node), build(kwargs_node)


def _node(obj: Any, leaves: list[torch.Tensor], objects: list[Any]) -> tuple:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("T", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, _LITERALS):
        # type() is part of the key: True == 1 == 1.0 must not share a graph.
        return ("C", type(obj).__name__, obj)
    t = type(obj)
    if t is list:
        return ("L", tuple(_node(o, leaves, objects) for o in obj))
    if t is tuple:
        return ("U", tuple(_node(o, leaves, objects) for o in obj))
    if t is dict:
        keys = tuple(obj.keys())
        return ("D", keys, tuple(_node(obj[k], leaves, objects) for k in keys))
    objects.append(obj)
    return ("O", f"{t.__module__}.{t.__qualname__}", id(obj))


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Signature, list[torch.Tensor]]:
    """Signature of a call and its tensor leaves, in a fixed order."""
    leaves: list[torch.Tensor] = []
    objects: list[Any] = []
    args_node = _node(tuple(args), leaves, objects)
    kwargs_node = _node(dict(sorted(kwargs.items())), leaves, objects)
    return Signature((args_node, kwargs_node), tuple(objects)), leaves


def _describe(node: tuple) -> str:
    kind = node[0]
    if kind == "T":
        return f"tensor{list(node[1])} {str(node[2]).replace('torch.', '')} on {node[3]}"
    if kind == "C":
        return repr(node[2])
    if kind == "O":
        return f"<{node[1]} object>"
    if kind == "L":
        return f"list of {len(node[1])}"
    if kind == "U":
        return f"tuple of {len(node[1])}"
    if kind == "D":
        return f"dict with keys {list(node[1])}"
    return repr(node)


def _diffs(a: tuple, b: tuple, path: str, out: list[str]) -> None:
    if a == b:
        return
    if a[0] != b[0] or a[0] in ("T", "C", "O"):
        out.append(f"{path}: {_describe(a)} vs {_describe(b)}")
        return
    if a[0] in ("L", "U"):
        if len(a[1]) != len(b[1]):
            out.append(f"{path}: {_describe(a)} vs {_describe(b)}")
            return
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            _diffs(x, y, f"{path}[{i}]", out)
        return
    # dicts
    if a[1] != b[1]:
        missing = sorted(set(map(str, a[1])) ^ set(map(str, b[1])))
        out.append(f"{path}: keys differ ({', '.join(missing) or 'order'})")
        return
    for k, x, y in zip(a[1], a[2], b[2]):
        _diffs(x, y, k if path == "kwargs" else f"{path}[{k!r}]", out)


def describe_diff(call: Signature, captured: Signature) -> list[str]:
    """Human-readable fields in which ``call`` differs from ``captured`` (call value first)."""
    out: list[str] = []
    _diffs(call.key[0], captured.key[0], "args", out)  # type: ignore[index]
    _diffs(call.key[1], captured.key[1], "kwargs", out)  # type: ignore[index]
    return out
