"""Nested values: one traversal for the whole library.

Copy-back, the weak views of a break's arguments, output copies, call signatures and tensor
listings all walk nested values; they walk them through this module, so they all agree on what
a container is. Structures are torch ``TreeSpec`` objects.

Contract:

* Containers are what torch's pytree registry holds (tuple, list, dict, OrderedDict, defaultdict,
  deque, namedtuple, torch.return_types, and diffusers ``BaseOutput`` / transformers
  ``ModelOutput`` subclasses, which register themselves when they are defined), walked with
  torch's functions, plus two kinds walked with functions of this library's own
  (:mod:`accel.graphs.nodes`; torch's registry is read, never written, so how ``torch.compile``,
  ``torch.export`` and pytree treat a user's types does not change):

  - dataclasses: every field that is set. Rebuilt through the constructor (as torch's
    ``register_dataclass`` and ``dataclasses.replace`` do); fields with ``init=False`` are set
    afterwards.
  - plain objects: instances with a ``__dict__``, not callable, whose class allocates them with
    ``object.__new__`` (or ``dict.__new__``: a dict subclass keeps its items too). Their
    attributes, sorted by name, are the children. Rebuilt like ``copy.copy``: ``__new__``, then
    the attributes, without ``__init__``.

* Everything else is a leaf: tensors, literals, modules and other callables, torch's opaque
  types, and objects this module cannot rebuild. ``torch.Size`` is always a leaf (recent torch
  registers it as a node, older releases do not; a size is a value either way).
* Two views. Values the library produces and owns (graph outputs, break outputs) open plain
  objects: ``into_objects=True``, the default. Values it passes on to someone else's code (call
  arguments, a break's recorded arguments) keep plain objects as leaves, ``into_objects=False``:
  the callee may rely on the object's identity or mutate it, so it must get the object itself.
  Dataclasses and registered containers are containers in both views. One exception: call
  signatures open the plain objects of the types a caller names as *request-scoped state* (a K/V
  cache a pipeline makes per call), and every plain object those hold, as the values view does
  (:func:`structure`'s ``state``): such objects are per call, so their identity means nothing,
  and what a call stores into them is recorded (:mod:`accel.graphs.stores`).
* A spec is a torch ``TreeSpec``; :func:`spec_key` is its hashable, exact form (a TreeSpec's own
  hash and equality are not: dict contexts are lists, and types compare by name). Rebuild values
  with :func:`unflatten`, not ``TreeSpec.unflatten`` (which knows only torch's registry).
* Hot paths (a call's signature, a break's copy-back, a replay's output copy) never build a
  TreeSpec: the walk here produces the spec key directly (:func:`flatten_key`), specs of known
  structures come from a cache (:func:`structure`), and :class:`Flat` keeps a value flattened
  once with its rebuild precompiled.

API: :func:`flatten`, :func:`flatten_key`, :func:`structure`, :func:`unflatten`, :func:`tensors`,
:func:`map_tensors`, :func:`clone`, :class:`Flat`; for messages, :func:`leaf_paths` (``[1]['k']``,
``.sample``), :func:`named_children`, :func:`describe`, :func:`describe_change`, :func:`align`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from . import nodes

__all__ = [
    "Aligned",
    "Flat",
    "align",
    "clone",
    "describe",
    "describe_change",
    "flatten",
    "flatten_key",
    "leaf_paths",
    "map_tensors",
    "mapping_keys",
    "named_children",
    "node_type",
    "spec_key",
    "structure",
    "tensors",
    "type_name",
    "unflatten",
]

TreeSpec = pytree.TreeSpec
_LEAF_SPEC = pytree.tree_flatten(0)[1]  # the leaf spec, however this torch release spells it
_KINDS = nodes.KINDS

if hasattr(TreeSpec, "children"):  # newer torch deprecates the children_specs attribute

    def _children(spec: TreeSpec) -> list[TreeSpec]:
        return spec.children()

else:

    def _children(spec: TreeSpec) -> list[TreeSpec]:
        return spec.children_specs


_NONE: frozenset[type] = frozenset()


def _walk(node: Any, leaves: list[Any], open_objects: bool, build: bool, state: frozenset[type] = _NONE) -> Any:
    """Flatten ``node`` into ``leaves``; return its spec (``build``) or its spec key.

    The one traversal of the module. Like ``pytree.tree_flatten`` with an ``is_leaf`` hook, but
    it can produce the hashable key without building TreeSpec objects (costly on hot paths).
    ``state``: plain object types opened in the arguments view too, with every plain object in them.
    """
    cls = type(node)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = nodes.kind(node)
    if kind is nodes.OBJECT and not open_objects and cls in state:
        open_objects = True  # request-scoped state: opened, and every plain object it holds
    if kind is nodes.BY_REGISTRY or kind is nodes.DATACLASS or (kind is nodes.OBJECT and open_objects):
        node_type: Any = cls
    elif kind is nodes.NAMEDTUPLE:
        node_type = collections.namedtuple
    else:
        leaves.append(node)
        return _LEAF_SPEC if build else None
    node_def = nodes.node(node_type)
    if node_def is None:
        leaves.append(node)
        return _LEAF_SPEC if build else None
    children, context = node_def.flatten_fn(node)
    if build:
        return TreeSpec(node_type, context, [_walk(c, leaves, open_objects, True, state) for c in children])
    return (node_type, _hashable(context), tuple([_walk(c, leaves, open_objects, False, state) for c in children]))


# --------------------------------------------------------------------------------------------
# Flattening, mapping, copying
# --------------------------------------------------------------------------------------------
_specs: dict[Hashable, TreeSpec] = {}  # known structures, so hot paths never build a TreeSpec
_MAX_SPECS = 4096


def structure(
    obj: Any, *, into_objects: bool = True, state: frozenset[type] = _NONE
) -> tuple[list[Any], Hashable, TreeSpec]:
    """``obj``'s leaves (depth first), its spec key and its spec, in one walk for a known structure.

    ``state``: in the arguments view, plain objects of these types are opened as in the values
    view, and every plain object they hold (request-scoped state: see the module's contract)."""
    leaves: list[Any] = []
    key = _walk(obj, leaves, into_objects, False, state)
    spec = _specs.get(key)
    if spec is None:
        spec = _walk(obj, [], into_objects, True, state)
        if len(_specs) >= _MAX_SPECS:  # callers that never repeat a structure must not grow it forever
            _specs.clear()
        _specs[key] = spec
    return leaves, key, spec


def flatten(obj: Any, *, into_objects: bool = True) -> tuple[list[Any], TreeSpec]:
    """``obj``'s leaves, depth first, and its spec (see the module contract for the two views)."""
    leaves, _, spec = structure(obj, into_objects=into_objects)
    return leaves, spec


def flatten_key(obj: Any, *, into_objects: bool = True) -> tuple[list[Any], Hashable]:
    """``obj``'s leaves and ``spec_key`` of its spec, without a spec: the cheapest walk."""
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves, into_objects, False)


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Rebuild a value of shape ``spec`` around ``leaves``."""
    leaves = list(leaves)
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"a structure of {spec.num_leaves} leaves cannot take {len(leaves)}")
    return _rebuilder(spec)(iter(leaves))


def tensors(obj: Any, *, into_objects: bool = True) -> list[torch.Tensor]:
    """Every tensor leaf of ``obj``, depth first."""
    return [x for x in flatten_key(obj, into_objects=into_objects)[0] if isinstance(x, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any, *, into_objects: bool = True) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor leaf; other leaves are shared."""
    leaves, spec = flatten(obj, into_objects=into_objects)
    return _rebuilder(spec)(iter([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves]))


def clone(obj: Any) -> Any:
    """A copy of ``obj``: tensor leaves cloned, containers rebuilt, other leaves shared."""
    return map_tensors(torch.Tensor.clone, obj)


def _rebuilder(spec: TreeSpec) -> Callable[[Iterator[Any]], Any]:
    """``spec.unflatten`` compiled into nested closures that draw leaves from an iterator."""
    if spec.is_leaf():
        return next
    unflatten_fn = nodes.node(spec.type).unflatten_fn
    context = spec.context
    parts = [_rebuilder(child) for child in _children(spec)]

    def rebuild(leaves: Iterator[Any]) -> Any:
        return unflatten_fn([part(leaves) for part in parts], context)

    return rebuild


class Flat:
    """A value flattened once, for code that meets values of its shape over and over (replays).

    ``leaves``, ``key`` and ``spec`` are :func:`structure` of the value; ``tensor_at`` lists the
    positions of its tensor leaves.
    """

    __slots__ = ("_rebuild", "key", "leaves", "spec", "tensor_at", "value")

    def __init__(self, value: Any, *, into_objects: bool = True) -> None:
        self.value = value
        self.leaves, self.key, self.spec = structure(value, into_objects=into_objects)
        self.tensor_at = tuple(i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor))
        self._rebuild = _rebuilder(self.spec)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_at]

    def clone(self) -> Any:
        """:func:`clone` of the value, without walking it again."""
        leaves = list(self.leaves)
        for i in self.tensor_at:
            leaves[i] = leaves[i].clone()
        return self._rebuild(iter(leaves))


# --------------------------------------------------------------------------------------------
# Specs: exact keys, field names, descriptions, side-by-side walks
# --------------------------------------------------------------------------------------------
def _hashable(context: Any) -> Hashable:
    """A hashable stand-in for a node's context (dict contexts are lists of keys)."""
    if type(context) is list:
        context = tuple(context)
    try:
        hash(context)
        return context
    except TypeError:
        pass
    if isinstance(context, (list, tuple)):
        return tuple(_hashable(c) for c in context)
    if isinstance(context, dict):
        return tuple((k, _hashable(v)) for k, v in context.items())
    if isinstance(context, (set, frozenset)):
        return frozenset(context)
    # Some registration's own context type: compared by what it shows.
    return ("context", type(context), repr(context))


def _node_key(spec: TreeSpec) -> Hashable:
    return (spec.type, _hashable(spec.context))


def spec_key(spec: TreeSpec) -> Hashable:
    """A hashable form of ``spec``: equal exactly when the structures are (types by identity)."""
    if spec.is_leaf():
        return None
    return (spec.type, _hashable(spec.context), tuple(spec_key(c) for c in _children(spec)))


def node_type(spec: TreeSpec) -> type:
    """The container type at the root of ``spec`` (a namedtuple's own class, not ``namedtuple``)."""
    return spec.context if spec.type is collections.namedtuple else spec.type


def type_name(spec: TreeSpec) -> str:
    return getattr(node_type(spec), "__name__", repr(node_type(spec)))


def _labels(spec: TreeSpec) -> list[tuple[str, Any]]:
    """How each child of ``spec`` is reached: ("index", i), ("key", k) or ("attr", name)."""
    t, ctx, n = spec.type, spec.context, spec.num_children
    ours = nodes.ours(t)
    if t is collections.namedtuple:
        return [("attr", f) for f in ctx._fields]
    if ours is nodes.DATACLASS:
        return [("attr", f) for f in ctx]
    if ours is nodes.OBJECT:
        keys, names = ctx
        return [("key", k) for k in keys or ()] + [("attr", a) for a in names]
    if t is collections.defaultdict:
        return [("key", k) for k in ctx[1]]
    if isinstance(t, type) and issubclass(t, dict) and isinstance(ctx, (list, tuple)) and len(ctx) == n:
        return [("key", k) for k in ctx]  # dict, OrderedDict, BaseOutput, ModelOutput
    if dataclasses.is_dataclass(t) and isinstance(ctx, list) and len(ctx) == 2 and len(ctx[0]) == n:
        return [("attr", f) for f in ctx[0]]  # torch's register_dataclass: [set fields, None fields]
    return [("index", i) for i in range(n)]


def _label_str(label: tuple[str, Any]) -> str:
    how, what = label
    return f".{what}" if how == "attr" else f"[{what!r}]"


def named_children(spec: TreeSpec) -> list[tuple[str, TreeSpec]]:
    """``spec``'s children with the path step to each, e.g. ``[0]``, ``['sample']``, ``.h``."""
    return [(_label_str(label), child) for label, child in zip(_labels(spec), _children(spec))]


def mapping_keys(spec: TreeSpec) -> list[Any] | None:
    """The keys of a dict-like node (None for other nodes and leaves)."""
    labels = _labels(spec) if not spec.is_leaf() else []
    keys = [what for how, what in labels if how == "key"]
    return keys if keys or (isinstance(spec.type, type) and issubclass(spec.type, dict)) else None


def field_names(spec: TreeSpec) -> list[str] | None:
    """The field or attribute names of a namedtuple, dataclass or plain object node (else None)."""
    if spec.is_leaf():
        return None
    names = [what for how, what in _labels(spec) if how == "attr"]
    return names if names or nodes.ours(spec.type) else None


def leaf_paths(spec: TreeSpec) -> list[str]:
    """The path of every leaf, in flattening order, e.g. ``[1]['pair'][0]`` or ``.sample``."""
    if spec.is_leaf():
        return [""]
    return [step + rest for step, child in named_children(spec) for rest in leaf_paths(child)]


def describe(spec: TreeSpec) -> str:
    """One line about a container: ``list of 3``, ``dict with keys ['a']``, ``Out with fields [...]``."""
    keys, names = mapping_keys(spec), field_names(spec)
    parts = ([f"keys {keys!r}"] if keys is not None else []) + ([f"fields {names}"] if names is not None else [])
    if not parts:
        return f"{type_name(spec)} of {spec.num_children}"
    return f"{type_name(spec)} with {' and '.join(parts)}"


def describe_change(before: TreeSpec, after: TreeSpec) -> str:
    """How two containers of the same type differ at their root."""
    if mapping_keys(before) != mapping_keys(after):
        return f"keys changed from {mapping_keys(before)} to {mapping_keys(after)}"
    if field_names(before) != field_names(after):
        noun = "attributes" if nodes.ours(before.type) is nodes.OBJECT else "fields"
        return f"{noun} changed from {sorted(field_names(before) or [])} to {sorted(field_names(after) or [])}"
    if before.num_children != after.num_children:
        return f"length changed from {before.num_children} to {after.num_children}"
    return f"changed from {describe(before)} to {describe(after)}"


class Aligned(NamedTuple):
    """One step of :func:`align`: a pair of leaves, or a pair of subtrees that differ at the root."""

    path: str
    a: TreeSpec
    b: TreeSpec
    a_leaf: int  # index of a's first leaf among all of a's leaves
    b_leaf: int

    @property
    def leaves(self) -> bool:
        return self.a.is_leaf() and self.b.is_leaf()


def align(a: TreeSpec, b: TreeSpec, path: str = "", a_leaf: int = 0, b_leaf: int = 0) -> Iterator[Aligned]:
    """Walk two specs side by side, depth first.

    Yields every pair of leaves found at the same place, and, in place of a subtree whose root
    differs (a leaf against a container, another container type, other keys or fields, another
    length), that pair of subtrees once. ``path`` prefixes every path; ``a_leaf`` and ``b_leaf``
    are the leaf indices the two specs start at.
    """
    if a.is_leaf() or b.is_leaf() or _node_key(a) != _node_key(b) or a.num_children != b.num_children:
        yield Aligned(path, a, b, a_leaf, b_leaf)
        return
    for (step, ca), cb in zip(named_children(a), _children(b)):
        yield from align(ca, cb, path + step, a_leaf, b_leaf)
        a_leaf += ca.num_leaves
        b_leaf += cb.num_leaves
