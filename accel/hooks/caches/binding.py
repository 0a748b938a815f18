"""The step caches on one denoiser: found, made safe under graphs, or refused by name.

:class:`CacheBinding` belongs to a denoiser's graph hook. At install and at the start of every
pipeline call (cheap: one walk over the module tree) it looks at every hook and forward wrapper
on the denoiser and its submodules:

* the library's own hooks, and hooks that run outside the captured call, are fine;
* a step cache the library knows (:mod:`accel.hooks.caches.rules`) gets its rule installed while graphs
  are on; its decisions then pick the graphs' paths, and its state survives captures;
* anything else, including a second step cache beside a first, is *foreign*: a graph would freeze
  whatever it decides or keeps, so graphs stay off for the denoiser while it is there, and one
  warning names it.

When what is found changes (a cache enabled or disabled between calls), the rules are installed
again and every graph of the denoiser is dropped: graphs captured without the cache would replay
without it.

diffusers' caches need a ``cache_context`` (the guidance branch) and a reset after each pipeline
call, which pipelines of ``CacheMixin`` denoisers provide. For a denoiser without ``CacheMixin``
(Z-Image in diffusers 0.42) the binding provides both: calls outside a context run in one named
``"inference"``, and the caches' state is reset where the pipeline call ends, as diffusers does
for the others.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

from ...graphs.patches import placed
from . import cache_dit, diffusers_caches  # noqa: F401  (registers the rules)
from .rules import CacheRule, rule_for_hook

__all__ = ["CacheBinding", "find_caches", "is_registry_forward"]

logger = logging.getLogger(__name__)

# diffusers hooks that are neither caches nor foreign to graphs: the context-parallel split and
# gather of parallel="ulysses" (accel/parallel runs them inside its graphs on purpose).
_BENIGN = ("ContextParallelSplitHook", "ContextParallelGatherHook")
DEFAULT_CONTEXT = "inference"


def is_registry_forward(forward: Any) -> bool:
    """Whether ``forward`` is the wrapper diffusers' ``HookRegistry`` puts on a module."""
    return isinstance(forward, functools.partial) and "HookRegistry.register_hook" in getattr(
        forward.func, "__qualname__", ""
    )


def _where(path: str) -> str:
    return f"'{path}'" if path else "the denoiser"


def find_caches(
    module: torch.nn.Module, own_hook: str
) -> tuple[dict[type[CacheRule], list[tuple[str, Any]]], Any, list[str]]:
    """What acts on ``module``'s forward besides the library: known caches' hooks by rule, a
    cache-dit context manager (or None), and descriptions of everything foreign.

    Hooks the denoiser's registry holds outside ``own_hook`` (registered after it) run before the
    graphs, eagerly, every call: they are not looked at.
    """
    found: dict[type[CacheRule], list[tuple[str, Any]]] = {}
    foreign: list[str] = []
    manager = cache_dit.cache_dit_manager(module)
    for path, m in module.named_modules():
        d = vars(m)
        registry = d.get("_diffusers_hook")
        if registry is not None:
            names = list(registry._hook_order)
            if m is module and own_hook in names:
                names = names[: names.index(own_hook)]
            for name in names:
                hook = registry.hooks[name]
                kind = type(hook)
                if kind.__module__.split(".")[0] == "accel" or kind.__name__ in _BENIGN or "offload" in name:
                    continue  # ours; or parallel's; or offloading, which switches graphs off itself
                rule = rule_for_hook(hook)
                if rule is None:
                    foreign.append(f"the {kind.__name__} hook {name!r} on {_where(path)}")
                else:
                    found.setdefault(rule, []).append((path, hook))
        forward = d.get("forward")
        wrapped = forward is not None and not is_registry_forward(forward) and "_hf_hook" not in d
        # Ours: compile=True's forms (accel.hooks.compiled.fused, a recipe's), placed by the library's
        # patches and captured by the graphs like any code. One written over them is foreign.
        wrapped = wrapped and not placed(m, "forward", "dict")
        # diffusers leaves the module's own forward as an attribute once its last hook is removed.
        wrapped = wrapped and not (
            getattr(forward, "__self__", None) is m and getattr(forward, "__func__", None) is type(m).forward
        )
        if wrapped and not (m is module and manager is not None):
            what = getattr(forward, "__qualname__", None) or type(forward).__name__
            foreign.append(f"a replaced forward ({what}) on {_where(path)}")
        # The denoiser's own torch hooks run around the diffusers hooks, outside the graphs.
        if m is not module and (m._forward_hooks or m._forward_pre_hooks):
            foreign.append(f"a torch forward hook on {_where(path)} (register_forward_hook / _pre_hook)")
    return found, manager, foreign


def _fingerprint(found: dict[type[CacheRule], list[tuple[str, Any]]], manager: Any, foreign: list[str]) -> Hashable:
    return (
        tuple(sorted((r.__name__, tuple((p, id(h)) for p, h in hooks)) for r, hooks in found.items())),
        id(manager) if manager is not None else None,
        tuple(foreign),
    )


class CacheBinding:
    """The caches of one denoiser and what graphs need of them (see the module docstring).

    Attributes:
        rules: the installed rules (empty while graphs are off or no cache is on).
        refused: why graphs must stay off for the denoiser (foreign hooks, caches that cannot
            run under graphs), or None.
        caches: labels of the caches found, whether or not their rules are installed.
    """

    def __init__(self, module: torch.nn.Module, name: str, own_hook: str) -> None:
        self.module = module
        self.name = name
        self.own_hook = own_hook
        self.rules: list[CacheRule] = []
        self.refused: str | None = None
        self.caches: list[str] = []
        self._found: tuple[Any, Any, list[str]] = ({}, None, [])
        self._seen: Hashable = None
        self._undo: list[Callable[[], None]] = []
        self._installed_for_graphs = False
        self.context_name: Callable[[], Hashable] = lambda: None
        self._said: set[str] = set()

    # -- what is there -----------------------------------------------------------------------
    def refresh(self, graphs: bool) -> bool:
        """Look again; (re)install rules if what is there changed or graphs went on or off.
        True if the rules changed (graphs captured before must go)."""
        found, manager, foreign = find_caches(self.module, self.own_hook)
        seen = _fingerprint(found, manager, foreign)
        if seen == self._seen and graphs == self._installed_for_graphs:
            return False
        self._seen = seen
        self.close()
        registry = vars(self.module).get("_diffusers_hook")
        if registry is not None:  # diffusers caches which submodules carry hooks (for cache_context)
            registry.invalidate_child_registries_cache()
        self._found = (found, manager, foreign)
        rules: list[CacheRule] = []
        refused = list(foreign)
        for rule_cls, hooks in found.items():
            for group in rule_cls.group(hooks):
                rules.append(rule_cls(self.module, group))
        if manager is not None:
            why = cache_dit.unsupported_cache_dit(manager)
            if why is None:
                rules.append(cache_dit.CacheDiTRule(self.module, manager, lambda: self.context_name()))
            else:
                refused.append(why)
        self.caches = [r.label for r in rules]
        if len(rules) > 1:
            refused.append(f"{len(rules)} step caches at once ({', '.join(self.caches)}); graphs take one")
        self.refused = "; ".join(refused) if refused else None
        if self.refused is not None:
            self._say(
                f"{self.name}: graphs are off for {type(self.module).__name__} while these are on: {self.refused}"
            )
        elif graphs:
            for rule in rules:
                self._undo.append(rule.install())
            self.rules = rules
            self._installed_for_graphs = True
            if rules:
                logger.info("%s: %s runs under graphs", self.name, ", ".join(self.caches))
        return True

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning(message)

    @property
    def active(self) -> bool:
        return bool(self.rules)

    @property
    def present(self) -> bool:
        """A step cache (or a hook the library does not know) is on the denoiser."""
        found, manager, foreign = self._found
        return bool(found or manager is not None or foreign)

    @property
    def has_diffusers_caches(self) -> bool:
        return bool(self._found[0])

    def close(self) -> None:
        """Uninstall every rule (the caches work as their libraries wrote them again)."""
        while self._undo:
            self._undo.pop()()
        self.rules = []
        self._installed_for_graphs = False

    # -- what the runner needs ---------------------------------------------------------------
    def key(self) -> Hashable:
        """Which of the caches' states the current call reads (its guidance branch)."""
        return tuple(rule.context() for rule in self.rules)

    def snapshot(self) -> Any:
        # The rules' own bookkeeping too: a capture's extra runs are not steps.
        return [(rule.snapshot(), set(rule._taken), copy.deepcopy(vars(rule.counts))) for rule in self.rules]

    def restore(self, snapshot: Any) -> None:
        for rule, (snap, taken, counts) in zip(self.rules, snapshot):
            rule.restore(snap)
            rule._taken = set(taken)
            vars(rule.counts).update(copy.deepcopy(counts))

    # -- per pipeline call -------------------------------------------------------------------
    @contextlib.contextmanager
    def call_context(self) -> Iterator[None]:
        """Around a denoiser call: a default cache context for diffusers' caches on a denoiser
        that has no ``cache_context`` of its own, when the pipeline set none."""
        if not self.has_diffusers_caches or hasattr(self.module, "cache_context"):
            yield
            return
        managers = [h.state_manager for hooks in self._found[0].values() for _, h in hooks]
        if any(m._context is not None for m in managers):
            yield
            return
        _set_cache_context(self.module, CacheContext(name=DEFAULT_CONTEXT))
        try:
            yield
        finally:
            _set_cache_context(self.module, None)

    @contextlib.contextmanager
    def forcing(self) -> Iterator[None]:
        """During a warm-up: each call computes its first step and takes the cached path after,
        so that both paths are captured (see :meth:`CacheRule.forced`)."""
        rules = list(self.rules)
        for rule in rules:
            rule.forcing = True
        try:
            yield
        finally:
            for rule in rules:
                rule.forcing = False

    def new_call(self) -> None:
        for rule in self.rules:
            rule.new_call()

    def end_call(self) -> None:
        """Where a pipeline call ends: reset diffusers' cache state for a denoiser whose
        pipeline does not (no ``CacheMixin``)."""
        if self.has_diffusers_caches and not hasattr(self.module, "_reset_stateful_cache"):
            HookRegistry.check_if_exists_or_initialize(self.module).reset_stateful_hooks()

    def describe(self) -> list[str]:
        """One line per cache: steps and blocks computed and cached in the last call."""
        return [rule.describe() for rule in self.rules]
