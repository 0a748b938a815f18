"""Call signatures: what must match for a captured graph to serve a call.

A signature is the call's structure (positional and keyword arguments and every container in
them) and a key per leaf: a tensor by (shape, dtype, device), a literal constant by (type, value),
a slice of such constants by its bounds, anything else by identity. Two calls with equal
signatures can share one graph: tensor values are copied into static buffers, everything else was
baked into the graph at capture.

Containers are what :mod:`accel.graphs.tree` opens in its arguments view; plain objects are
leaves there, matched by identity, except *request-scoped state*: objects of the types the
runner is given (:attr:`~accel.graphs.runner.GraphRunner.state_types`, filled by recipes: a K/V
cache a pipeline makes for every call, its per-layer caches in a list, each holding a tensor or
None). Those, and every plain object they hold, are keyed by their structure: type, attributes,
and what each holds (a tensor's shape and dtype, ``None``, a constant), never by identity; so two
calls' caches share a graph, as do the cond and uncond branches' caches of one call. What a call
stores into them is :mod:`accel.graphs.stores`' to record and put back. Other plain objects stay
matched by identity: a step cache's state object passed to every step is read and called by its
graphs' breaks as that very object. A state object the library cannot open safely (its class
makes instances otherwise than ``object.__new__``, or keeps state in ``__slots__``) is refused
(:class:`Unopenable`) where it holds a tensor: keyed by identity, its graph would read the
tensors it held at capture. The runner runs such a call eagerly, with one warning.

Literals are matched with their type, so ``True``, ``1`` and ``1.0`` never share a graph.
Objects matched by identity (a module, a callback, a plain object) are held by the signature, so
their ids cannot be reused by other objects while a graph keyed on them exists.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import nodes, tree

__all__ = ["LITERALS", "Signature", "Unopenable", "describe_diff", "flatten"]

# Matched by value: immutable, so a graph that baked one in serves any equal one (torch.Size too).
LITERALS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, torch.Size)
_BY_IDENTITY = "identity"  # first item of an identity leaf key; tensor and literal keys start with a type


class Unopenable(TypeError):
    """A call holds a tensor in an object the signature cannot open (see the module's contract).

    ``type_name``: the object's class, qualified; ``field``: where the call holds it.
    """

    def __init__(self, type_name: str, field: str) -> None:
        super().__init__(
            f"{field} is a {type_name}, request-scoped state holding tensors that a call signature cannot open "
            "(its class makes its instances otherwise than object.__new__, or keeps state in __slots__): a graph "
            "keyed on its identity would read the tensors it held at capture"
        )
        self.type_name = type_name
        self.field = field


@dataclass(frozen=True)
class Signature:
    """A hashable call signature plus what is needed to rebuild the call around new tensors.

    ``key`` is ``(spec key, leaf keys)``; ``objects`` holds the identity-matched objects strongly
    (a graph baked them in). ``spec`` and ``template`` (the call's leaves with ``None`` in place
    of every tensor, so the caller's tensors are not kept alive) serve :meth:`rebuild`.
    ``state``: the types of request-scoped state the signature opened (see the module's contract).
    """

    key: Hashable
    objects: tuple[Any, ...]
    spec: tree.TreeSpec = field(compare=False, repr=False)
    template: tuple[Any, ...] = field(compare=False, repr=False)
    tensor_at: tuple[int, ...] = field(compare=False, repr=False)
    state: frozenset[type] = field(default=frozenset(), compare=False, repr=False)

    @property
    def leaf_keys(self) -> tuple[Hashable, ...]:
        return self.key[1]  # type: ignore[index]

    @property
    def state_inputs(self) -> tuple[int, ...]:
        """Positions, among the call's tensors, of those that request-scoped state holds (a
        per-call cache's tensors, which a graph reads as state)."""
        found = self.__dict__.get("_state_inputs")
        if found is None:
            inside = _inside_objects(self.spec, False)
            found = tuple(k for k, leaf in enumerate(self.tensor_at) if inside[leaf])
            object.__setattr__(self, "_state_inputs", found)
        return found

    def field(self, tensor: int) -> str:
        """The field of the call's tensor number ``tensor``: ``args[0]``, ``kv_cache.layers[3].k``."""
        return _field(self.spec, self.tensor_at[tensor])

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from this signature with ``tensors`` as the tensor leaves."""
        leaves = list(self.template)
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        args, kwargs = tree.unflatten(leaves, self.spec)
        return args, kwargs


_NONE: frozenset[type] = frozenset()


def flatten(
    args: tuple[Any, ...], kwargs: dict[str, Any], state: frozenset[type] = _NONE
) -> tuple[Signature, list[torch.Tensor]]:
    """Signature of a call and its tensor leaves, in a fixed order (keywords sorted by name).

    ``state``: the types of request-scoped state (see the module's contract); raises
    :class:`Unopenable` for such an object that cannot be opened and holds a tensor.
    """
    leaves, structure, spec = tree.structure(
        (tuple(args), dict(sorted(kwargs.items()))), into_objects=False, state=state
    )
    keys: list[Hashable] = []
    tensors: list[torch.Tensor] = []
    tensor_at: list[int] = []
    objects: list[Any] = []
    template = list(leaves)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            keys.append((torch.Tensor, tuple(leaf.shape), leaf.dtype, leaf.device))
            tensors.append(leaf)
            tensor_at.append(i)
            template[i] = None
        elif isinstance(leaf, LITERALS):
            keys.append((type(leaf), leaf))
        elif type(leaf) is slice and all(isinstance(p, LITERALS) for p in (leaf.start, leaf.stop, leaf.step)):
            keys.append((slice, (leaf.start, leaf.stop, leaf.step)))  # a value, unhashable before Python 3.12
        else:
            if state and _unopenable(leaf, state, spec, structure, i):
                raise Unopenable(f"{type(leaf).__module__}.{type(leaf).__qualname__}", _field(spec, i))
            keys.append((_BY_IDENTITY, type(leaf), id(leaf)))
            objects.append(leaf)
    key = (structure, tuple(keys))
    return Signature(key, tuple(objects), spec, tuple(template), tuple(tensor_at), state), tensors


_inside_state: dict[Hashable, list[bool]] = {}  # per structure: which leaves request-scoped state holds


def _unopenable(leaf: Any, state: frozenset[type], spec: tree.TreeSpec, structure: Hashable, i: int) -> bool:
    """Whether ``leaf``, kept by identity, is state that holds a tensor: an object of a state type
    that could not be opened, or such an object inside one that was."""
    if type(leaf) not in state:
        inside = _inside_state.get(structure)
        if inside is None:
            if len(_inside_state) >= 1024:
                _inside_state.clear()
            inside = _inside_state[structure] = _inside_objects(spec, False)
        if not inside[i]:
            return False
    return nodes.holds_hidden_tensors(leaf)


def _inside_objects(spec: tree.TreeSpec, inside: bool) -> list[bool]:
    """For every leaf of ``spec``, whether an opened plain object holds it (at any depth): in a
    call's spec, only request-scoped state is one."""
    if spec.is_leaf():
        return [inside]
    inside = inside or nodes.ours(spec.type) is nodes.OBJECT
    return [flag for _, child in tree.named_children(spec) for flag in _inside_objects(child, inside)]


def _field(spec: tree.TreeSpec, leaf: int) -> str:
    """The field of leaf number ``leaf`` of a call's ``(args, kwargs)`` spec: ``args[1]``, ``kv_cache.cache``."""
    path = tree.leaf_paths(spec)[leaf]  # "[0][1]..." or "[1]['name']..."
    if path.startswith("[0]"):
        return "args" + path[3:]
    rest = path[3:]
    head, _, tail = rest.partition("]")
    return head[2:-1] + tail if head.startswith("['") else "kwargs" + rest


# --------------------------------------------------------------------------------------------
# Explaining a miss
# --------------------------------------------------------------------------------------------
def _describe_leaf(key: Hashable) -> str:
    head, *rest = key  # type: ignore[misc]
    if head is torch.Tensor:
        shape, dtype, device = rest
        return f"tensor{list(shape)} {str(dtype).replace('torch.', '')} on {device}"
    if head == _BY_IDENTITY:
        cls = rest[0]
        return f"<{cls.__module__}.{cls.__qualname__} object>"
    if head is slice:
        return repr(slice(*rest[0]))
    return repr(rest[0])


def _describe(sig: Signature, spec: tree.TreeSpec, first_leaf: int) -> str:
    return _describe_leaf(sig.leaf_keys[first_leaf]) if spec.is_leaf() else tree.describe(spec)


def _diffs(call: Signature, captured: Signature, a: Any, b: Any, path: str, ia: int, ib: int, out: list[str]) -> None:
    for step in tree.align(a, b, path, ia, ib):
        if step.leaves:
            ka, kb = call.leaf_keys[step.a_leaf], captured.leaf_keys[step.b_leaf]
            if ka != kb:
                text = f"{step.path}: {_describe_leaf(ka)} vs {_describe_leaf(kb)}"
                if ka[0] == _BY_IDENTITY and kb[0] == _BY_IDENTITY and ka[1] is kb[1]:  # type: ignore[index]
                    text += " (another object of the type: one per call is state its recipe can name)"
                out.append(text)
            continue
        keys_a, keys_b = tree.mapping_keys(step.a), tree.mapping_keys(step.b)
        if keys_a is not None and keys_b is not None and keys_a != keys_b:
            differ = sorted(set(map(str, keys_a)) ^ set(map(str, keys_b)))
            out.append(f"{step.path}: keys differ ({', '.join(differ) or 'order'})")
        else:
            a_text = _describe(call, step.a, step.a_leaf)
            b_text = _describe(captured, step.b, step.b_leaf)
            out.append(f"{step.path}: {a_text} vs {b_text}")


def describe_diff(call: Signature, captured: Signature) -> list[str]:
    """Human-readable fields in which ``call`` differs from ``captured`` (call value first).

    Positional arguments are named ``args[i]``, keyword arguments by their name, e.g.
    ``encoder_hidden_states: tensor[1, 64, 3584] bfloat16 on cuda:0 vs tensor[1, 128, 3584] ...``.
    """
    out: list[str] = []
    if call.key == captured.key:
        return out
    (_, args_a), (_, kwargs_a) = tree.named_children(call.spec)
    (_, args_b), (_, kwargs_b) = tree.named_children(captured.spec)
    _diffs(call, captured, args_a, args_b, "args", 0, 0, out)
    ia, ib = args_a.num_leaves, args_b.num_leaves
    names_a, names_b = tree.mapping_keys(kwargs_a), tree.mapping_keys(kwargs_b)
    if names_a != names_b:
        differ = sorted(set(names_a or ()) ^ set(names_b or ()))
        out.append(f"kwargs: keys differ ({', '.join(differ) or 'order'})")
        return out
    for name, (_, ca), (_, cb) in zip(names_a or (), tree.named_children(kwargs_a), tree.named_children(kwargs_b)):
        _diffs(call, captured, ca, cb, name, ia, ib, out)
        ia += ca.num_leaves
        ib += cb.num_leaves
    return out
