"""What a step cache needs to run under graphs, and the registry of caches the library knows.

A step cache (diffusers' FirstBlockCache, TaylorSeer, MagCache; cache-dit's DBCache) decides on
the host, per call or per block, whether to compute or to reuse what it kept from an earlier
step. Captured as it is, a graph would freeze the capture's decision and the capture's tensors.
A :class:`CacheRule` rewrites, only while it is installed, the few places where the cache:

* decides: the function becomes a decision break (:func:`accel.graphs.bcg.eager_on_graph` with
  ``decision=True``), so every path gets its own chain (:mod:`accel.graphs.branches`);
* changes host state (step counters, lists of cached steps): the function becomes an eager break,
  so it runs at every replay, once;
* keeps tensors for a later step: they go into fixed buffers (:class:`~accel.hooks.caches.slots.Slots`)
  or are kept as owned copies by a break (``keeps_inputs=True``), never as graph memory.

Everything else in the cache (its arithmetic on the hidden states) is captured as it is, so a
replay computes what the cache computes eagerly, bit for bit. Rules look their state up when they
run (the cache's own state manager or context, whatever the current guidance branch is), never
through objects recorded at capture: caches make new state objects for every pipeline call.

A rule also gives the runner what a capture needs: a snapshot of the cache's state and a way back
to it (a capture runs the call several times), and the name of the state the current call reads
(``context``: the guidance branch), which the graphs of a call are matched on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

from ...graphs import bcg

__all__ = ["CacheRule", "CallCounts", "decision", "effect", "register_rule", "rule_for_hook"]

logger = logging.getLogger(__name__)


class CallCounts:
    """Computed and cached steps (and blocks) of one cache, this pipeline call and in all."""

    def __init__(self) -> None:
        self.steps = [0, 0]  # computed, cached (this call)
        self.blocks = [0, 0]
        self.total_steps = [0, 0]
        self.total_blocks = [0, 0]

    def add(self, computed: bool, blocks_computed: int, blocks_cached: int, *, step: bool = True) -> None:
        """Count a decision: a step (unless ``step=False``: a cache that decides per block
        counts its step once) and the blocks it computed and cached."""
        i = 0 if computed else 1
        self.steps[i] += step
        self.total_steps[i] += step
        self.blocks[0] += blocks_computed
        self.blocks[1] += blocks_cached
        self.total_blocks[0] += blocks_computed
        self.total_blocks[1] += blocks_cached

    def new_call(self) -> None:
        self.steps = [0, 0]
        self.blocks = [0, 0]

    def describe(self) -> str:
        (sc, sk), (bc, bk) = self.steps, self.blocks
        return f"{sc} computed / {sk} cached steps, {bc} computed / {bk} cached blocks"


def decision(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as a decision break; dynamo does not trace into it (compiled blocks call it)."""
    return torch.compiler.disable(bcg.eager_on_graph(fn, name=name, decision=True, inline_nested=True))


def effect(fn: Callable[..., Any], name: str, *, keeps_inputs: bool = False) -> Callable[..., Any]:
    """``fn`` as an eager break that runs at every replay (host state, owned copies of tensors)."""
    return torch.compiler.disable(bcg.eager_on_graph(fn, name=name, keeps_inputs=keeps_inputs, inline_nested=True))


class CacheRule:
    """Base class: one cache on one denoiser, made safe under graphs while installed.

    Subclasses set ``hook_classes`` (the diffusers hook classes, by name, they serve) and
    implement :meth:`install` (patches; returns the undo), :meth:`snapshot` / :meth:`restore`,
    :meth:`context` and :attr:`counts`.
    """

    label: ClassVar[str] = "cache"
    hook_classes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, module: torch.nn.Module, hooks: list[tuple[str, Any]]) -> None:
        self.module = module
        self.hooks = hooks  # (module path, hook) pairs this rule serves
        self.counts = CallCounts()
        self.forcing = False
        self._taken: set[Hashable] = set()

    def forced(self, site: Hashable, natural: Any, cached: Any) -> Any:
        """The decision to take at ``site``: ``natural`` (what the cache decided), except during
        a warm-up, where every decision after the first of its site and branch in a pipeline
        call is ``cached``, so that the warm-up's calls capture both paths (the first step
        computes what a cached step reuses)."""
        if not self.forcing:
            return natural
        key = (self.context(), site)
        if key not in self._taken:
            self._taken.add(key)
            return natural
        return cached

    def new_call(self) -> None:
        self.counts.new_call()
        self._taken.clear()

    @classmethod
    def group(cls, hooks: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
        """Split this rule's hooks into independent caches (one rule each); all together by default."""
        return [hooks]

    def install(self) -> Callable[[], None]:
        raise NotImplementedError

    def snapshot(self) -> Any:
        raise NotImplementedError

    def restore(self, snapshot: Any) -> None:
        raise NotImplementedError

    def context(self) -> Hashable:
        return None

    def describe(self) -> str:
        return f"{self.label}: {self.counts.describe()}"


_RULES: dict[str, type[CacheRule]] = {}


def register_rule(cls: type[CacheRule]) -> type[CacheRule]:
    """Register a rule for the hook classes it names (usable as a decorator)."""
    for name in cls.hook_classes:
        _RULES[name] = cls
    return cls


def rule_for_hook(hook: Any) -> type[CacheRule] | None:
    """The rule serving ``hook``'s class (matched by name along its MRO), or None."""
    for klass in type(hook).__mro__:
        rule = _RULES.get(klass.__name__)
        if rule is not None:
            return rule
    return None
