"""What a captured forward reads besides tensor values, and a check of it that costs well under a millisecond.

A replay runs no Python: every Python value that decided what a module's forward ran was frozen
into the module's graphs when they were captured, and the weights are read at the addresses they
had then. :class:`Watch` tells whether any of that changed since it last looked. It runs once per
pipeline call for a denoiser and at every call of a component (:mod:`accel.hooks.state.follow`), never
per step.

The rule (one rule, not a list of cases; :mod:`accel.hooks.state.watch_rule` has its parts, and
:mod:`accel.hooks.state.watch_values` how one value compares):

* every module of the tree, every attention processor (a module's ``processor`` that is not a
  module) and every diffusers hook registry (``_diffusers_hook``) is watched through its
  ``__dict__``: plain values (numbers, strings, bools, None, tuples of them) by value; dicts,
  lists and sets by their shallow content; any other object by identity. That covers a processor
  swapped or edited in place, the attention backend a processor holds, PEFT's scales and active,
  disabled and merged adapters, DoRA, fused projections, train/eval, forward chunking, gradient
  checkpointing, a ``forward`` or method set on a submodule, torch and diffusers hooks;
* every parameter and buffer by identity, address and in-place version: the weights;
* diffusers' active attention backend (what ``attention_backend(...)`` sets around a call) and
  its checks switch, torch's global module hooks, and torch's settings that pick the kernels a
  capture records (TF32, the SDPA kernel switches and ``sdpa_kernel(...)``, autocast).

The check compares, in a few C-level passes over lists fixed when the module was last looked at
(one ``itemgetter`` per watched dictionary, one ``data_ptr`` and one ``_version`` per tensor),
against a snapshot taken then. Anything it sees changed sends the caller to :meth:`Watch.look`,
which walks the module again, says what changed, and takes a new snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import watch_rule as rule
from . import watch_values as values
from .weights import storage_tensors, tensor_key

__all__ = ["Look", "Watch"]

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")
_values = dict.values


@dataclasses.dataclass
class Look:
    """What :meth:`Watch.look` found changed since the look before.

    Attributes:
        first: there was no look before (nothing to compare with).
        weights: a parameter or buffer was added, removed, replaced, moved or written in place.
        changes: what changed in the Python state, one phrase each (module path first).
        unwatchable: objects whose state a watch cannot see (graphs must stay off).
        record: the whole Python state (not the weights), comparable with ``==``: equal records
            are states whose graphs are interchangeable.
    """

    first: bool
    weights: bool
    changes: list[str]
    unwatchable: list[str]
    record: Any


@dataclasses.dataclass
class _Spec:
    """One watched object: its path, its dictionary and what of it was seen at the last look."""

    path: str
    obj: Any
    d: dict[str, Any]
    seen: dict[str, Any]  # watched key -> value (containers as shallow copies)
    fast: tuple[str, ...] = ()  # the keys the fast check compares (none: the length only)
    getter: Any = None
    snap: Any = None


class _Plan:
    """The lists the fast check walks, built by one look."""

    def __init__(self, specs: list[_Spec], tensors: list[torch.Tensor], globals_now: tuple[Any, ...]) -> None:
        self.specs = specs
        self.dicts = [s.d for s in specs]
        self.lens = [len(d) for d in self.dicts]
        # One itemgetter per set of keys (most modules share theirs with many others), mapped
        # over the dictionaries that have those keys.
        groups: dict[tuple[str, ...], tuple[Any, list[dict[str, Any]], list[Any]]] = {}
        for s in specs:
            if s.getter is not None:
                group = groups.setdefault(s.fast, (s.getter, [], []))
                group[1].append(s.d)
                group[2].append(s.snap)
        self.groups = list(groups.values())
        self.tensors = tensors
        self.ptrs = list(map(_data_ptr, tensors))
        self.versioned = [t for t in tensors if not t.is_inference()]  # inference tensors have no version
        self.versions = list(map(_version, self.versioned))
        self.weight_keys = frozenset(map(tensor_key, tensors))
        self.globals = rule.copy_globals(globals_now)
        self.next_id = RemovableHandle.next_id
        # Torch hooks are registered through handles numbered from one global counter: while it
        # has not moved, an empty hook dictionary is still empty, and a non-empty one can only
        # have lost a hook (its length). When it moved, every hook dictionary's length is
        # compared, and the non-empty ones by what their hooks compute (values.hook_keys), not by
        # handle: a hook registered again around every call is the same hook.
        self.hook_dicts = [s.d[k] for s in specs for k in rule.HOOK_DICTS if k in s.seen]
        self.hook_lens = [len(h) for h in self.hook_dicts]
        self.hooked = [h for h in self.hook_dicts if h]
        self.hooked_lens = [len(h) for h in self.hooked]
        self.hooked_keys = [values.hook_keys(h) for h in self.hooked]
        # Values whose class compares by value (a one-element tensor equals an equal one) and
        # objects whose own dictionary is watched: compared by identity, grouped by key.
        self.ident: list[tuple[Any, list[dict[str, Any]]]] = []
        self.ident_in: list[tuple[Any, list[dict[str, Any]], bool]] = []
        by_key: dict[str, list[dict[str, Any]]] = {}
        in_key: dict[tuple[str, bool], list[dict[str, Any]]] = {}
        for s in specs:
            for k, v in s.seen.items():
                if values.kind(v) == values.CONTAINER:
                    if any(values.by_identity(x) for x in values.contents(v)):
                        in_key.setdefault((k, isinstance(v, dict)), []).append(s.d)
                elif values.by_identity(v) or k in rule.OWNERS:
                    by_key.setdefault(k, []).append(s.d)
        self.ident = [(operator.itemgetter(k), ds) for k, ds in by_key.items()]
        self.ident_in = [(operator.itemgetter(k), ds, is_dict) for (k, is_dict), ds in in_key.items()]
        self.ident_ids = self._ident_ids()

    def _ident_ids(self) -> list[int]:
        objs = itertools.chain.from_iterable(map(get, ds) for get, ds in self.ident)
        inner = itertools.chain.from_iterable(
            itertools.chain.from_iterable(map(_values if is_dict else iter, map(get, ds)))
            for get, ds, is_dict in self.ident_in
        )
        return list(map(id, itertools.chain(objs, inner)))

    def unchanged(self) -> bool:
        try:
            return self.state_same() and self.weights_same()
        except Exception:  # a key gone, a replaced tensor compared by value (ambiguous): changed
            return False

    def state_same(self) -> bool:
        """Every watched dictionary as at the look (the parameter and buffer dictionaries too:
        a tensor replaced), and the process-wide switches. May raise (then it is not)."""
        if RemovableHandle.next_id != self.next_id:
            if list(map(len, self.hook_dicts)) != self.hook_lens:
                return False
            if list(map(values.hook_keys, self.hooked)) != self.hooked_keys:
                return False
            self.next_id = RemovableHandle.next_id
        elif list(map(len, self.hooked)) != self.hooked_lens:
            return False  # a hook removed (that takes no handle number)
        return (
            rule.globals_now() == self.globals
            and list(map(len, self.dicts)) == self.lens
            and all(list(map(get, ds)) == snaps for get, ds, snaps in self.groups)
            and (not self.ident_ids or self._ident_ids() == self.ident_ids)
        )

    def weights_same(self) -> bool:
        """Every tensor at the address and version it had at the look."""
        return list(map(_data_ptr, self.tensors)) == self.ptrs and list(map(_version, self.versioned)) == self.versions

    def weights(self) -> frozenset[tuple[int, int, int]]:
        """The tensors as (identity, address, version) at the look, in no order: cache-dit moves
        a block list to the end of its parent's children during a call."""
        return self.weight_keys


class Watch:
    """Watches one module (and, for offloading, the own dictionary of ``extra`` modules).

    :meth:`unchanged` is the per-call check; :meth:`look` walks the module again and says what
    changed. :meth:`forget` lets go of everything the watch holds.
    """

    def __init__(self, module: torch.nn.Module, extra: tuple[torch.nn.Module, ...] = ()) -> None:
        self._module = module
        self._extra = extra
        self._plan: _Plan | None = None

    def unchanged(self) -> bool:
        """Whether nothing watched changed since the last :meth:`look` (False before the first)."""
        plan = self._plan
        return plan is not None and plan.unchanged()

    def state_unchanged(self) -> bool:
        """The Python-state half of :meth:`unchanged` (parameter dictionaries included)."""
        plan = self._plan
        try:
            return plan is not None and plan.state_same()
        except Exception:
            return False

    def weights_unchanged(self) -> bool:
        """The other half: every tensor at the address and version it had."""
        plan = self._plan
        return plan is not None and plan.weights_same()

    def look(self) -> Look:
        """Walk the module, compare with the last look, and keep what is there now."""
        old = self._plan
        specs, tensors, unwatchable = self._walk()
        new = _Plan(specs, tensors, rule.globals_now())
        self._plan = new
        record = rule.record(new.specs, new.globals)
        if old is None:
            return Look(True, False, [], unwatchable, record)
        changes = rule.differences(old.specs, new.specs)
        if old.globals != new.globals:
            changes = rule.global_differences(old.globals, new.globals) + changes
        return Look(False, old.weights() != new.weights(), changes, unwatchable, record)

    @property
    def watched_dicts(self) -> int:
        """How many dictionaries the last look watches."""
        return len(self._plan.dicts) if self._plan is not None else 0

    @property
    def watched_tensors(self) -> int:
        return len(self._plan.tensors) if self._plan is not None else 0

    def forget(self) -> None:
        self._plan = None
        self._module = None  # type: ignore[assignment]
        self._extra = ()

    def _walk(self) -> tuple[list[_Spec], list[torch.Tensor], list[str]]:
        specs: list[_Spec] = []
        tensors: list[torch.Tensor] = []
        unwatchable: list[str] = []
        seen_ids: set[int] = set()
        stack: list[tuple[str, Any]] = [("", self._module)]
        while stack:
            path, m = stack.pop()
            if id(m) in seen_ids:
                continue
            seen_ids.add(id(m))
            why = rule.unwatchable(m)
            if why is not None:
                unwatchable.append(f"{path or 'the module'} ({type(m).__name__}: {why})")
            d = m.__dict__
            keys = rule.module_keys(m, d)
            if m is self._module:
                keys = [k for k in keys if k not in rule.AROUND_THE_GRAPHS]
            specs.append(_spec(path, m, d, keys))
            for k in rule.WEIGHT_KEYS:
                for t in d.get(k, {}).values():
                    if t is not None:
                        tensors.extend(storage_tensors(t))
            for key in rule.OWNERS:
                owned = d.get(key)
                if owned is None or values.kind(owned) != values.OBJECT or isinstance(owned, torch.nn.Module):
                    continue
                if id(owned) in seen_ids:
                    continue
                seen_ids.add(id(owned))
                where = rule.join(path, key)
                why = rule.unwatchable(owned)
                if why is not None:
                    unwatchable.append(f"{where} ({type(owned).__name__}: {why})")
                    continue
                od = owned.__dict__
                specs.append(_spec(where, owned, od, rule.object_keys(od)))
            children = d.get("_modules", {})
            stack.extend((rule.join(path, name), c) for name, c in reversed(list(children.items())) if c is not None)
        for i, m in enumerate(self._extra):
            if m is not self._module:
                d = m.__dict__
                specs.append(_spec(f"<offload root {i}>", m, d, rule.offload_keys(d)))
        return specs, tensors, unwatchable


@functools.lru_cache(maxsize=1024)
def _getter(keys: tuple[str, ...]) -> Any:
    return operator.itemgetter(*keys)


def _spec(path: str, obj: Any, d: dict[str, Any], keys: list[str]) -> _Spec:
    seen = {k: values.copy(d[k]) for k in keys}
    # The fast check compares the non-empty parameter and buffer dictionaries too (a tensor
    # replaced), leaves hook dictionaries to _Plan (by the handle counter and what their hooks
    # compute) and leaves out empty child, parameter and buffer dictionaries: a module gains a first child or
    # tensor only under a name its forward did not read when it was captured (an optional
    # submodule held as a plain None changes the dictionary's length, which is compared). Not so
    # a ModuleDict or ModuleList's children, which its owner reads by content (PEFT's DoRA
    # vectors); its empty hook dictionaries are left to the handle counter as anyone's are.
    listed = isinstance(obj, rule.CONTAINER_MODULES)
    unread = rule.unread(obj)
    fast = [
        k
        for k in keys
        if k not in unread
        and k not in rule.HOOK_DICTS  # compared by what the hooks compute (_Plan.state_same)
        and (k not in rule.SPARSE or seen[k] or (listed and k == "_modules"))
    ]
    fast += [k for k in rule.WEIGHT_KEYS if d.get(k) or (listed and k in d)]
    spec = _Spec(path, obj, d, seen)
    if fast:
        spec.fast = tuple(fast)
        spec.getter = _getter(spec.fast)
        snap = tuple(seen[k] if k in seen else dict(d[k]) for k in fast)
        spec.snap = snap if len(snap) > 1 else snap[0]  # an itemgetter of one key returns the value itself
    return spec
