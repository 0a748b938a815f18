"""What a call stores into the containers and state objects it is given: recorded at capture, put back by every replay.

A replay runs no Python, so a call that fills a container it is given (a causal VAE's per-frame
feature cache: ``decoder(x, feat_cache=[None] * n, feat_idx=[0])`` stores each convolution's last
input frame and counts in ``feat_idx``; a DiT's prefix K/V cache, filled at a pipeline call's first
step) would leave the caller's container as it was. A capture therefore records what the call left
in each container it was given, and every replay puts the same contents into the caller's
containers.

Contract:

* *Given containers* (found by :mod:`accel.graphs.containers`) are the lists, dicts and deques in a
  call's arguments, the fields of its dataclasses, and the attributes of its *request-scoped state*:
  objects of the types the runner is given as state (``GraphRunner.state_types``, which recipes
  fill) and every plain object those hold, at any depth of tuples, lists, dicts, namedtuples,
  dataclasses and state (what the call signature opens; :mod:`accel.graphs.signature`). What they
  hold at entry is part of the signature (a tensor's shape, a constant's value: ``None`` against a
  tensor, ``feat_idx``'s int), so a replay meets them as the capture did. The same container given
  twice in one call is not replayed (a capture sees two containers): such a call runs eagerly
  (:func:`accel.graphs.containers.given_twice`).
* For every given container whose contents changed, the capture keeps its final contents (a
  list's items, a dict's keys and values, an object's attribute names and values, those the call
  added or deleted included), each item as one of:

  - a plain constant (the signature's literals: ``None``, ``"Rep"``, an int): put back as it is;
  - one of the call's tensor inputs (that very object, also one it found in the container and
    kept): the caller's tensor of the call being replayed;
  - an object the signature matches by identity: that object;
  - a tensor of the call's output (that very object): the tensor of the output's copy returned
    to the caller, so the container and the output share it as they do eagerly;
  - any other tensor the call made, in a graph segment or as a break's output (a new object in
    every run): a *stored tensor*, at a fixed address that every replay rewrites. Every replay
    puts a copy of it into the caller's container, made on the replay's stream right after the
    replay and before any other graph of the pool replays (the pool's replay order). The caller
    owns what it gets, as eagerly: a container kept across calls, or across other graphs'
    replays, keeps its values. The same stored tensor in several slots is one copy. A view of
    memory the caller never sees (a slice of an intermediate) is copied on its own, which nothing
    can tell from eager but the memory it takes.

  Anything else refuses the capture with a :class:`~accel.graphs.errors.BreakError` naming the
  field: a tensor that is the same object in every run but no input (made outside the call: a
  module's attribute), a tensor on another device than the graph's, a tensor that shares memory
  with another the caller gets (a view of the output, of an input, of another stored tensor: its
  copy would not share it), any other object (a new
  list, a module that is no argument), a store made inside an eager break (a replay runs the
  break on the capture's containers, not the caller's; debug mode is one such break), an item
  stored into a state object that is also a dict, and any store at all without a warm-up run
  (nothing to tell a tensor the call made from one it found). A call whose two runs store
  differently is refused too, and so is one that writes in place into a tensor its state holds
  (:mod:`accel.graphs.capture`: a replay would write the graph's copy, not the caller's tensor).
* Memory: the chain holds a stored tensor that lives in the pool as a non-owning view, as a
  break's pool-resident arguments are held: within a replay the graph writes it and the copy
  reads it before any other graph of the pool runs, so later captures may reuse that memory, and
  a stored tensor pins nothing (one outside the pool is a break's boundary buffer, which the graph
  holds anyway). What it costs is per replay: the copies it hands out (``RunnerStats.stored_bytes``,
  the bytes a replay of every chain copies), allocated outside the pool and freed when the caller
  drops them (a causal VAE's ``clear_cache``), as the tensors an eager call stores are.

Request-scoped state, end to end (Qwen-Image 2.1's ``QwenImage21KVCache``, FLUX.2 klein KV's
``Flux2KVCache``): a recipe names the cache's top-level class (``Recipe.state_types``), and:

* given state (a new cache per pipeline call, passed at every step): the first step's call
  ("extract") finds the layers' ``k``/``v`` None and stores cloned K/V into them; its graph makes
  them (stored tensors) and every replay puts copies into the caller's cache, as eagerly. The
  later steps' calls ("cached") find tensors there: another signature, whose graph reads them as
  static inputs. The cond and uncond caches of true CFG share both graphs (same structure).
* returned state (the first step makes the cache and returns it): the output's copy is a new
  cache with copies of its tensors (:mod:`accel.graphs.tree` opens plain objects in outputs); the
  later steps pass it back, as given state.
* copies: the cached steps' static inputs are copied from the caller's cache at a replay only
  where they do not hold it already (another tensor object, or one written since: its version
  counter; ``RunnerStats.state_bytes_kept`` counts what was not copied). Without CFG, a cache is
  copied in once per pipeline call; with true CFG the two caches alternate on one graph, so each
  step copies its branch's cache (the prefix's K/V of every layer). Resident memory above eager:
  one set of static inputs the size of one branch's cache.

For a recipe that uses it: name only the top-level class (the per-layer caches it holds are
opened with it); the captured callable must take the cache as an argument, at any depth of its
arguments (a cache reached through a closure, a module attribute or a break's own arguments is
not seen, and a store made inside an eager break is refused); the mode (``"extract"``) and a write
``slice(0, n)`` are keyed by value, so a call that differs in them is another graph; what the
extract step stores must be tensors the call made (the stock ``.clone()``: a view of an input or
of the output is refused, naming the field); and joining the guidance branches into one batch
(``Recipe.batch_cfg``) would have to join and split their caches too, which nothing here does.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from . import tree
from .containers import Given, Path, attributes_of, has_attributes, label
from .copyback import PoolMap, views_of_pool_tensors
from .errors import BreakError
from .signature import LITERALS

__all__ = ["Recording", "Stores", "record"]

_UNSET = object()

# How an item of a container's final contents is put back (see the module's contract).
CONST, INPUT, OBJECT, OUTPUT, MADE = "constant", "input", "object", "output", "made"


# --------------------------------------------------------------------------------------------
# What one run stored
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Item:
    """One item of a container's final contents: how (``kind``) and from what (``ref``) it is put back."""

    kind: str
    ref: Any

    def key(self) -> Hashable:
        if self.kind == CONST:
            return (CONST, type(self.ref), self.ref)
        if self.kind == OBJECT:
            return (OBJECT, id(self.ref))
        return (self.kind, self.ref)


@dataclasses.dataclass(frozen=True)
class Stored:
    """The final contents of one given container (``keys``: a dict's, or an object's attribute
    names where ``attributes``, in order)."""

    path: Path
    keys: tuple[Any, ...] | None
    items: tuple[Item, ...]
    attributes: bool = False


@dataclasses.dataclass
class Recording:
    """What one run of a call stored: each changed container's final contents, and the tensors
    made by the call that its ``MADE`` items stand for: ``made`` (held strongly: the capture's own,
    which its chain keeps; :meth:`released` drops them), ``refs`` (weakly, to tell a tensor made in
    every run from one made once outside the call), ``likes`` (their geometry, on the meta device)
    and ``fields`` (where each was first stored)."""

    stored: tuple[Stored, ...]
    made: list[torch.Tensor]
    refs: list[weakref.ref[torch.Tensor]]
    likes: list[torch.Tensor]
    fields: list[str]

    def layout(self) -> Hashable:
        """Equal for two runs that stored alike (the made tensors by geometry and dtype)."""
        items = tuple((s.path, s.keys, tuple(i.key() for i in s.items)) for s in self.stored)
        return items, tuple((tuple(t.shape), t.stride(), t.dtype) for t in self.likes)

    def released(self) -> Recording:
        """This recording without its strong references (a warm-up run's, kept for the capture)."""
        self.made = []
        return self

    def check_against(self, warm: Recording | None, name: str) -> None:
        """BreakError unless this run (the capture's) stored as ``warm`` (the last warm-up run) did,
        with tensors it made itself."""
        if self.stored and warm is None:
            raise BreakError(
                f"{name}: the call stores into {self.fields[0] if self.fields else label(self.stored[0].path)}, "
                "which needs a warm-up run (warmup_runs >= 1) to tell a tensor the call made from one it found"
            )
        if warm is not None and self.layout() != warm.layout():
            raise BreakError(f"{name}: two runs of the same inputs stored differently into the containers given")
        for field, t, ref in zip(self.fields, self.made, warm.refs if warm is not None else ()):
            if ref() is t:
                raise BreakError(
                    f"{name}: the call stores into {field} a tensor it did not make (the same object in every run) "
                    "and that is not one of its inputs: a replay cannot put it back"
                )


def record(
    given: Given, name: str, inputs: Sequence[torch.Tensor], objects: Sequence[Any], output: Any, device: torch.device
) -> Recording:
    """What the run that ``given`` was taken before stored (see the contract); BreakError, naming
    the field, for what a replay cannot put back. ``inputs``: the call's tensor leaves;
    ``objects``: what its signature matches by identity; ``device``: the graph's."""
    input_at = {id(t): k for k, t in enumerate(inputs)}
    object_ids = {id(o) for o in objects}
    out_leaves = tree.Flat(output)
    output_at = {id(out_leaves.leaves[i]): i for i in out_leaves.tensor_at}
    made: list[torch.Tensor] = []
    made_at: dict[int, int] = {}
    fields: list[str] = []
    stored = []
    for path, container, now in given.changed():
        where = label(path)
        attributes = has_attributes(container)
        if attributes and isinstance(container, dict):
            raise BreakError(
                f"{name}: the call stores into {where}, a {type(container).__name__} that is a dict with attributes: "
                "a replay cannot put both back"
            )
        keys = now[: len(now) // 2] if isinstance(container, dict) or attributes else None
        values = list(now[len(now) // 2 :] if keys is not None else now)
        items = []
        for i, v in enumerate(values):
            field = f"{where}.{keys[i]}" if attributes else f"{where}[{keys[i] if keys is not None else i!r}]"
            if isinstance(v, torch.Tensor):
                if id(v) in input_at:
                    items.append(Item(INPUT, input_at[id(v)]))
                elif id(v) in output_at:
                    items.append(Item(OUTPUT, output_at[id(v)]))
                else:
                    if v.device != device:
                        raise BreakError(
                            f"{name}: the call stores into {field} a tensor on {v.device}, which a graph on "
                            f"{device} does not write: a replay cannot put it back"
                        )
                    if id(v) not in made_at:
                        made_at[id(v)] = len(made)
                        made.append(v)
                        fields.append(field)
                    items.append(Item(MADE, made_at[id(v)]))
            elif isinstance(v, LITERALS):
                items.append(Item(CONST, v))
            elif id(v) in object_ids:
                items.append(Item(OBJECT, v))
            else:
                raise BreakError(
                    f"{name}: the call stores a {type(v).__name__} into {field}, which a replay cannot put back "
                    "(only tensors and plain constants)"
                )
        stored.append(Stored(path, keys, tuple(items), attributes))
    _check_own_memory(name, made, fields, inputs, out_leaves.tensors)
    likes = [torch.empty_like(t, device="meta") for t in made]
    return Recording(tuple(stored), made, [weakref.ref(t) for t in made], likes, fields)


def _check_own_memory(
    name: str, made: list[torch.Tensor], fields: list[str], inputs: Sequence[torch.Tensor], outputs: list[torch.Tensor]
) -> None:
    """BreakError where a stored tensor shares memory with another tensor the caller gets (an
    output, an input, another stored tensor): a replay hands stored tensors back as copies, which
    would not share it (eagerly, a write into one shows in the other)."""
    owners: dict[int, str] = {}
    for what, tensors in (("the output", outputs), ("an input", inputs)):
        for t in tensors:
            if t.untyped_storage().nbytes():
                owners.setdefault(t.untyped_storage().data_ptr(), what)
    for field, t in zip(fields, made):
        storage = t.untyped_storage()
        if not storage.nbytes():
            continue
        other = owners.get(storage.data_ptr())
        if other is not None:
            raise BreakError(
                f"{name}: the call stores into {field} a view of {other}, which a replay would hand back as a copy "
                "that no longer shares its memory"
            )
        owners[storage.data_ptr()] = f"the tensor stored at {field}"


# --------------------------------------------------------------------------------------------
# What a chain puts back at every replay
# --------------------------------------------------------------------------------------------
class Stores:
    """The final contents a chain puts into the caller's containers, and its stored tensors.

    ``pool_map``: the capture's pool; a stored tensor in it is held as a non-owning view (see the
    contract), any other (a break's boundary buffer, which the graph holds anyway) as it is.
    """

    def __init__(self, recording: Recording, pool_map: PoolMap | None = None) -> None:
        self.stored = recording.stored
        made = list(recording.made)
        self.made: list[torch.Tensor] = views_of_pool_tensors(made, pool_map) if pool_map is not None else made
        self._reads_output = any(i.kind == OUTPUT for s in self.stored for i in s.items)

    def nbytes(self) -> int:
        """Bytes every replay copies out into the caller's containers."""
        return sum(t.numel() * t.element_size() for t in self.made)

    def apply(self, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor], output: Any) -> None:
        """Put the recorded final contents into the caller's containers, right after a replay and
        before any other graph of the pool replays. ``inputs``: the call's tensor leaves;
        ``output``: the copy of the output returned to the caller."""
        copies = [t.clone() for t in self.made]
        out_leaves = tree.flatten_key(output)[0] if self._reads_output else []
        root = (args, kwargs)
        for stored in self.stored:
            node: Any = root
            for how, what in stored.path:
                node = getattr(node, what) if how == "attr" else node[what]
            values = []
            for item in stored.items:
                kind, ref = item.kind, item.ref
                if kind == MADE:
                    values.append(copies[ref])
                elif kind == INPUT:
                    values.append(inputs[ref])
                elif kind == OUTPUT:
                    values.append(out_leaves[ref])
                else:  # CONST, OBJECT
                    values.append(ref)
            if stored.attributes:
                _set_attributes(node, stored.keys or (), values)
            else:
                _write(node, stored.keys, values)


def _set_attributes(obj: Any, names: tuple[str, ...], values: list[Any]) -> None:
    """Leave ``obj`` with exactly these attributes (a dataclass: these fields), as the call left its own."""
    for n, _ in attributes_of(obj):
        if n not in names:
            object.__delattr__(obj, n)
    for n, v in zip(names, values):
        if getattr(obj, n, _UNSET) is not v:
            object.__setattr__(obj, n, v)  # as the class's own attribute store would, frozen or not


def _write(container: Any, keys: tuple[Any, ...] | None, values: list[Any]) -> None:
    if keys is None:
        if isinstance(container, list):
            container[:] = values
        else:
            container.clear()
            container.extend(values)
        return
    if _same_keys(list(container), keys):  # the same keys in the same order, some maybe added
        for k, v in zip(keys, values):
            if container.get(k, _UNSET) is not v:
                container[k] = v
    else:
        container.clear()
        container.update(zip(keys, values))


def _same_keys(now: list[Any], keys: tuple[Any, ...]) -> bool:
    """Whether ``now`` (a dict's keys at entry) are the first of ``keys``, in order."""
    if len(now) > len(keys):
        return False
    try:
        return all(a is b or bool(a == b) for a, b in zip(now, keys))
    except Exception:  # a key whose == is no plain bool: rewrite the whole dict
        return False
