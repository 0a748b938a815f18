"""Keeping one graph hook's graphs in step with what they read: the weights, and the Python state.

A replay runs no Python and reads weights by address. Once per pipeline call for a denoiser, at
every call of a component (and after a warm-up), never per step, the :class:`Follower` asks its
:class:`~accel.hooks.state.watch.Watch` whether anything a captured forward depends on changed:

* weights added, removed, replaced, moved, cast or written in place (a LoRA, ``load_state_dict``,
  ``.to()``): every graph of the module is dropped and captured again on its next call;
* Python state (an attention processor or its attributes, the attention backend, PEFT's scales
  and switches, train/eval, a replaced ``forward``...): graphs are kept per state
  (:mod:`accel.hooks.state.states`), so the new state's graphs are captured on its next call, and a
  state seen before replays its own; one line names what changed;
* weights offloaded (moved between calls): graphs off while offloading is on; an object whose
  state cannot be watched: graphs off, in one warning, while it is there;
* with compiled blocks, a recompile drops the graphs too. The step caches on a denoiser are
  looked at again (:mod:`accel.hooks.caches`): their rules installed, graphs off while a hook
  nobody wrote a rule for is there.

While nothing changed the whole check is the watch's fast comparison (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..compiled import compile as compile_mod
from .states import StateKeys, kept_under, pending_keys
from .watch import Look, Watch
from .weights import offload_reason

if TYPE_CHECKING:
    from ...graphs.runner import GraphRunner
    from ..caches import CacheBinding
    from ..options import AcceleratorOptions

__all__ = ["FollowedHook", "Follower"]

# The hook's messages, whichever of its parts says them.
logger = logging.getLogger("accel.hooks.graph_hook")

_WEIGHTS_CHANGED = "weights changed since capture (LoRA, load_state_dict, a move or a cast)"


def _summary(changes: list[str], shown: int = 2) -> str:
    more = len(changes) - shown
    return ", ".join(changes[:shown]) + (f" and {more} more" if more > 0 else "")


class FollowedHook(Protocol):
    """What a :class:`Follower` reads and switches of the graph hook it serves (a
    :class:`~accel.hooks.graph_hook.GraphHook`, which makes its follower): the hook's module, its
    runner and caches, whether its graphs are on. The follower knows the hook by this much only.
    """

    name: str
    options: AcceleratorOptions
    runner: GraphRunner
    caches: CacheBinding | None
    # Graphs may be used now; the recipe is in the module (with or without graphs); compiled blocks.
    active: bool
    recipe_installed: bool
    compiled: bool
    # The top-level component whose offload hooks move this module's weights, when it is a submodule.
    offload_root: weakref.ref[torch.nn.Module] | None

    @property
    def compile_options(self) -> dict[str, Any]: ...

    def module(self) -> torch.nn.Module | None:
        """The hooked module (None before the hook is initialised, or once it is gone)."""
        ...

    def deactivate(self, reason: str) -> None:
        """Graphs off (every call runs eagerly), ``reason`` kept for reports."""
        ...

    def reactivate(self) -> None:
        """Graphs on again."""
        ...


class Follower:
    """What one graph hook (:class:`FollowedHook`) last saw of its module.

    Attributes:
        recompile_drops: how often a recompile dropped the module's graphs (compiled only).
        offloaded: why the weights move between calls (graphs off meanwhile), or None.
        unwatchable: what cannot be watched (graphs off meanwhile), or None.
        epoch: bumped whenever the weights change; part of every graph's key.
        state: the number of the Python state the module is in; part of every graph's key.
        events: what the check at the start of the last call did (drops, state switches).
    """

    def __init__(self, hook: FollowedHook) -> None:
        self.hook = hook
        self.watch: Watch | None = None
        self.epoch = 0
        self.state = 0
        self.states = StateKeys(hook.options.max_entries)
        self.events: list[str] = []
        self.compiles: int | None = None
        self.recompile_drops = 0
        self.offloaded: str | None = None
        self.unwatchable: str | None = None
        self.refused_by_caches: str | None = None
        self.arranged: Callable[[], None] | None = None
        self._caches_changed = False
        self._previous = (0, 0)
        self._fresh = True

    def key(self) -> Hashable:
        """What the runner matches a call on besides its signature (called at every call)."""
        caches = self.hook.caches
        if caches is not None and caches.active:
            return (self.epoch, self.state, caches.key())
        return (self.epoch, self.state)

    def follow(self) -> None:
        """Keep graphs in step with what they read (see the module docstring). Runs once per
        pipeline call for a denoiser, at every call for a component (and after a warm-up)."""
        hook = self.hook
        module = hook.module()
        if module is None:
            return
        if self.watch is None:
            root = hook.offload_root() if hook.offload_root is not None else None
            self.watch = Watch(module, (root,) if root is not None else ())
            hook.runner.key_extra = self.key
        elif self.offloaded is None and self._unchanged():
            self.events = []
            self._follow_compiles()
            self._fresh = not kept_under(list(hook.runner.store.entries), (self.epoch, self.state))
            return
        self.events = []
        self._apply(module, self.watch.look())
        self._fresh = not kept_under(list(hook.runner.store.entries), (self.epoch, self.state))

    def captured(self) -> None:
        """After a call that captured: a forward that changed its own state while it was being
        captured (transformers installs its output-capturing hooks in its first call) leaves
        graphs of the state it ended in, not of the one the call began in."""
        if self.watch is None or self._unchanged():
            return
        look = self.watch.look()
        if self._fresh and not look.weights and not look.unwatchable:
            # Every graph of the state the call began in was captured in this call, after the
            # eager runs that made the change: they belong to the state it ended in.
            self.states.relabel(self.state, look.record)
            logger.debug("%s: changed by its own first call: %s", self.hook.name, _summary(look.changes))
            return
        module = self.hook.module()
        if module is None:
            return
        if look.changes and not look.weights and self.hook.active:
            # Which of this call's graphs saw the change is not known: none of them is kept.
            self._drop_graphs(f"{_summary(look.changes)} changed during a capture", logging.INFO)
        self._apply(module, look)

    def _apply(self, module: torch.nn.Module, look: Look) -> None:
        hook = self.hook
        self._take(look)
        # Also without graphs: a denoiser without CacheMixin gets its caches' context from it.
        caches_allow = self._follow_caches()
        if not (hook.active or self.offloaded or self.unwatchable) or not caches_allow:
            return
        # Offload hooks sit on a pipeline's top-level components: the VAE's, not its decoder's.
        root = hook.offload_root() if hook.offload_root is not None else None
        reason = offload_reason(root if root is not None else module)
        if reason is not None:
            if self.offloaded is None:
                self.offloaded = reason
                hook.runner.release()
                hook.deactivate(f"{reason} move the weights between calls")
                logger.warning(
                    "%s: %s move the weights between calls, so graphs would read stale memory; running "
                    "eagerly while offloading is on",
                    hook.name,
                    reason,
                )
            return
        if self.offloaded is not None:
            logger.info("%s: offloading is off again; graphs are used from the next warm-up", hook.name)
            self.offloaded = None
            hook.reactivate()
        if not self._follow_watchable(look):
            return
        if not look.first and hook.active:
            self._say(look)
        self._follow_compiles()

    def _unchanged(self) -> bool:
        # The check allocates a tuple per watched dictionary; a collection started among them
        # would walk every object of the process (milliseconds). Freed before the collector is
        # on again, they leave its counts as they were.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self.watch is not None and self.watch.unchanged()
        finally:
            if enabled:
                gc.enable()

    def _take(self, look: Look) -> None:
        """Move the keys to what ``look`` found, with or without graphs (a state number must
        never stand for two states)."""
        if look.weights:
            self.epoch += 1
            self.states.clear()
        self._previous = (self.epoch - look.weights, self.state)
        self.state, _ = self.states.number(look.record)

    def _say(self, look: Look) -> None:
        """Drop or keep graphs for what changed, and say so in one line."""
        hook, store = self.hook, self.hook.runner.store
        old, new = self._previous, (self.epoch, self.state)
        if look.weights:
            if self._drop_graphs(_WEIGHTS_CHANGED, logging.WARNING):
                self.events.append(f"graphs dropped: {_WEIGHTS_CHANGED}")
            pending = pending_keys(list(store.recapture), old, new)
            store.recapture.clear()
            store.recapture.update(pending)
            return
        if new == old or not look.changes or self._caches_changed:
            return
        kept = kept_under(list(store.entries), new)
        pending = pending_keys([*store.entries, *store.recapture], old, new) - set(store.entries)
        store.recapture.update(pending)
        if not (kept or pending):
            return  # nothing captured yet: nothing to say
        what = _summary(look.changes)
        if kept:
            then = f"replaying the {kept} graphs kept for this state"
        else:
            then = "graphs for this state are captured on the next call"
        logger.info("%s: %s; %s", hook.name, what, then)
        self.events.append(f"state switched ({what}): {then}")

    def _follow_watchable(self, look: Look) -> bool:
        """Graphs off while something cannot be watched; False while they are off for that."""
        hook = self.hook
        if look.unwatchable:
            why = _summary(look.unwatchable)
            if self.unwatchable is None:
                hook.runner.release(recapture=True)
                hook.deactivate(f"the state of {why} cannot be watched")
                logger.warning(
                    "%s: graphs are off for %s: the state of %s cannot be watched, so a replay could run "
                    "what the model no longer would",
                    hook.name,
                    hook.name,
                    why,
                )
            self.unwatchable = why
            return False
        if self.unwatchable is not None:
            logger.info("%s: nothing unwatchable is left; graphs are used again", hook.name)
            self.unwatchable = None
            hook.reactivate()
        return True

    def _follow_compiles(self) -> None:
        if not self.hook.compiled:
            return
        # Dynamo runs the newest compiled version whose guards pass, so a recompile (a new
        # shape) changes the kernels every older shape runs too; a graph captured before it
        # replays the older ones: valid, but no longer what the model computes without graphs
        # (measured on Z-Image 1024x1024: 0.16 max abs on the latents after 3 steps).
        compiles = compile_mod.compiled_graph_count()
        moved = self.compiles is not None and compiles != self.compiles
        if moved and self._drop_graphs("inductor compiled again (a new shape)", logging.INFO):
            self.recompile_drops += 1
            self.events.append("graphs dropped: inductor compiled again (a new shape)")
        self.compiles = compiles

    def _follow_caches(self) -> bool:
        """Install rules for the step caches found on the denoiser, or switch graphs off while a
        hook nobody wrote a rule for is on it; False while graphs are off for that reason."""
        hook = self.hook
        caches = hook.caches
        self._caches_changed = False
        if caches is None:
            return True
        changed = caches.refresh(graphs=hook.recipe_installed and not self.offloaded)
        if changed and hook.compiled:
            self.undo_arrangement()
            if caches.present:
                self.arranged = compile_mod.arrange_for_hooks(hook.module(), hook.compile_options)
        if not hook.recipe_installed:
            return True
        if caches.refused is not None:
            if self.refused_by_caches is None:
                # Captured again at the first call after whatever kept graphs off is gone.
                hook.runner.release(recapture=True)
                hook.deactivate(caches.refused)
            self.refused_by_caches = caches.refused
            return False
        if self.refused_by_caches is not None:
            logger.info("%s: the hooks that kept graphs off are gone; graphs are used again", hook.name)
            self.refused_by_caches = None
            hook.reactivate()
        if changed:
            self._caches_changed = True
            if self._drop_graphs("the step caches on it changed", logging.INFO):
                self.events.append("graphs dropped: the step caches on it changed")
        hook.runner.state = caches if caches.active else None
        return True

    def undo_arrangement(self) -> None:
        if self.arranged is not None:
            self.arranged()
            self.arranged = None

    def forget(self) -> None:
        """Let go of everything watched (the hook is removed)."""
        if self.watch is not None:
            self.watch.forget()
        self.states.clear()

    def _drop_graphs(self, why: str, level: int) -> int:
        hook = self.hook
        dropped = hook.runner.release(recapture=True)
        if dropped:
            logger.log(
                level, "%s: %s; dropped %d graphs, each is captured again on its next call", hook.name, why, dropped
            )
        return dropped
