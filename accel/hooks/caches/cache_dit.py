"""cache-dit's DBCache under graphs (an optional extra: ``pip install "bcg-diffusers[cache-dit]"``).

``cache_dit.enable_cache(pipe, ...)`` wraps the denoiser's forward so that, during a call, its block
list is a ``CachedBlocks`` module: the first Fn blocks run, a residual check decides whether the
middle blocks run or last step's residual is added, the last Bn blocks run. Every piece of state it
keeps, and every decision, goes through its context manager (the object at
``transformer._context_manager``): its step counters, the Fn/Bn buffers, the TaylorSeer
calibrator, the step mask. The rule makes those methods breaks on that one object while installed:

* ``can_cache`` is the decision (with the guidance branch it was taken in, which picks the buffers);
* ``set_context``, ``mark_step_begin``, ``add_cached_step`` run as eager breaks (host bookkeeping);
* ``set_*_buffer`` keep owned copies of the tensors they are given (the calibrator updates too);
* ``apply_cache`` runs eagerly on the kept buffers and hands its result to the next segment.

The blocks, and the arithmetic between them, are captured unchanged. Pruning (DBPrune) decides per
block and is refused: graphs stay off for that denoiser, with one line saying so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .rules import CacheRule, decision, effect

__all__ = ["CacheDiTRule", "cache_dit_manager", "unsupported_cache_dit"]

# Methods of cache-dit's CachedContextManager, by what they do under graphs.
_EFFECTS = ("mark_step_begin", "add_cached_step")
_KEEPERS = ("set_Fn_buffer", "set_Fn_encoder_buffer", "set_Bn_buffer", "set_Bn_encoder_buffer")


def cache_dit_manager(module: torch.nn.Module) -> Any | None:
    """The cache-dit context manager steering ``module`` (a denoiser it cached), or None."""
    if not vars(module).get("_is_cached"):
        return None
    manager = vars(module).get("_context_manager")
    return manager if manager is not None and hasattr(manager, "can_cache") else None


def unsupported_cache_dit(manager: Any) -> str | None:
    """Why a cache-dit setup cannot run under graphs, or None."""
    kind = type(manager).__name__
    if kind != "CachedContextManager":
        return f"cache-dit's {kind} (only DBCache's CachedContextManager is supported under graphs)"
    if getattr(manager, "_persistent_context", False):
        return "cache-dit with a persistent context (a transformer cached on its own, not through its pipeline)"
    return None


class CacheDiTRule(CacheRule):
    """One cache-dit context manager, made safe under graphs."""

    label = "cache-dit DBCache"

    def __init__(self, module: torch.nn.Module, manager: Any, context: Callable[[], Hashable]) -> None:
        super().__init__(module, [])
        self.manager = manager
        self._context = context
        self._blocks = sum(1 for _ in _blocks_of(module))

    def install(self) -> Callable[[], None]:
        m = self.manager
        originals: dict[str, Any] = {}

        def patch(name: str, value: Any) -> None:
            originals[name] = vars(m).get(name, _MISSING)
            setattr(m, name, value)

        cls = type(m)
        can_cache = cls.can_cache.__get__(m)
        fn, bn = cls.Fn_compute_blocks.__get__(m), cls.Bn_compute_blocks.__get__(m)

        def decide(*args: Any, **kwargs: Any) -> tuple[bool, bool]:
            cached = self.forced("can_cache", bool(can_cache(*args, **kwargs)), True)
            n = self._blocks
            kept = min(n, fn() + bn())
            self.counts.add(not cached, kept if cached else n, n - kept if cached else 0)
            return cached, bool(m.is_separate_cfg_step())

        decide_break = decision(decide, f"{self.label}: use the cache")
        patch("can_cache", lambda *a, **k: decide_break(*a, **k)[0])

        set_context = cls.set_context.__get__(m)
        context_break = effect(lambda *a, **k: set_context(*a, **k) and None, f"{self.label}: set_context")
        patch("set_context", lambda *a, **k: (context_break(*a, **k), m._current_context)[1])
        for name in _EFFECTS:
            original = getattr(cls, name).__get__(m)
            brk = effect(lambda *a, original=original, **k: original(*a, **k) and None, f"{self.label}: {name}")
            patch(name, brk)
        for name in _KEEPERS:
            patch(name, effect(getattr(cls, name).__get__(m), f"{self.label}: {name}", keeps_inputs=True))
        patch("apply_cache", effect(cls.apply_cache.__get__(m), f"{self.label}: apply_cache"))

        def undo() -> None:
            for name, previous in originals.items():
                if previous is _MISSING:
                    vars(m).pop(name, None)
                else:
                    setattr(m, name, previous)

        return undo

    def snapshot(self) -> Any:
        m = self.manager
        current = m._current_context.name if m._current_context is not None else None
        return current, copy.deepcopy(m._cached_context_manager), m._current_step_refreshed

    def restore(self, snapshot: Any) -> None:
        m = self.manager
        current, contexts, refreshed = snapshot
        m._cached_context_manager = copy.deepcopy(contexts)
        m._current_context = m._cached_context_manager.get(current) if current is not None else None
        m._current_step_refreshed = refreshed

    def context(self) -> Hashable:
        return self._context()


def _blocks_of(module: torch.nn.Module) -> Any:
    classes = tuple(getattr(module, "_repeated_blocks", None) or ())
    return (m for m in module.modules() if type(m).__name__ in classes)


_MISSING = object()
