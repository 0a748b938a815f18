"""Keeping one graph hook's graphs in step with what they read by address.

A graph reads weights by address: when they change or move (a LoRA, ``load_state_dict``, a cast,
a move) every graph of the module is dropped and captured again on its next call; while they are
offloaded (moved between calls) graphs are off. With compiled blocks, a recompile drops the
graphs too. The step caches on a denoiser are looked at again (:mod:`accel.hooks.caches`): their
rules installed, graphs off while a hook nobody wrote a rule for is there. Runs once per pipeline
call for a denoiser, at every call for a component (and after a warm-up), never per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import compile as compile_mod
from .weights import offload_reason, weights_fingerprint

if TYPE_CHECKING:
    from .graph_hook import GraphHook

__all__ = ["Follower"]

# The hook's messages, whichever of its parts says them.
logger = logging.getLogger("accel.hooks.graph_hook")


class Follower:
    """What one :class:`~accel.hooks.graph_hook.GraphHook` last saw of its module.

    Attributes:
        recompile_drops: how often a recompile dropped the module's graphs (compiled only).
        offloaded: why the weights move between calls (graphs off meanwhile), or None.
    """

    def __init__(self, hook: GraphHook) -> None:
        self.hook = hook
        self.fingerprint: int | None = None
        self.compiles: int | None = None
        self.recompile_drops = 0
        self.offloaded: str | None = None
        self.refused_by_caches: str | None = None
        self.arranged: Callable[[], None] | None = None

    def follow(self) -> None:
        """Keep graphs in step with the weights they read by address: drop every graph when the
        weights changed or moved since capture (each is captured again on its next call), and
        switch graphs off while the weights are offloaded (on again once offloading stops). With
        compiled blocks, likewise drop every graph once inductor compiled again (see
        :mod:`accel.hooks.compile`).

        Runs once per pipeline call for a denoiser, at every call for a component (and after a
        warm-up), never per step.
        """
        hook = self.hook
        module = hook._module_ref() if hook._module_ref is not None else None
        if module is None:
            return
        # Also without graphs: a denoiser without CacheMixin gets its caches' context from it.
        caches_allow = self._follow_caches()
        if not (hook.active or self.offloaded) or not caches_allow:
            return
        # Offload hooks sit on a pipeline's top-level components: the VAE's, not its decoder's.
        root = hook.offload_root() if hook.offload_root is not None else None
        reason = offload_reason(root if root is not None else module)
        if reason is not None:
            if self.offloaded is None:
                self.offloaded = reason
                hook.runner.release()
                hook._deactivate(f"{reason} move the weights between calls")
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
            hook._reactivate()
            self.fingerprint = None
        fingerprint = weights_fingerprint(module)
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            self._drop_graphs(
                "weights changed since capture (LoRA, load_state_dict, a move or a cast)", logging.WARNING
            )
        self.fingerprint = fingerprint
        if hook.compiled:
            # Dynamo runs the newest compiled version whose guards pass, so a recompile (a new
            # shape) changes the kernels every older shape runs too; a graph captured before it
            # replays the older ones: valid, but no longer what the model computes without
            # graphs (measured on Z-Image 1024x1024: 0.16 max abs on the latents after 3 steps).
            compiles = compile_mod.compiled_graph_count()
            moved = self.compiles is not None and compiles != self.compiles
            if moved and self._drop_graphs("inductor compiled again (a new shape)", logging.INFO):
                self.recompile_drops += 1
            self.compiles = compiles

    def _follow_caches(self) -> bool:
        """Install rules for the step caches found on the denoiser, or switch graphs off while a
        hook nobody wrote a rule for is on it; False while graphs are off for that reason."""
        hook = self.hook
        caches = hook.caches
        if caches is None:
            return True
        changed = caches.refresh(graphs=hook._recipe_installed and not self.offloaded)
        if changed and hook.compiled:
            self.undo_arrangement()
            if caches.present:
                self.arranged = compile_mod.arrange_for_hooks(hook._module_ref(), hook.compile_options)
        if not hook._recipe_installed:
            return True
        if caches.refused is not None:
            if self.refused_by_caches is None:
                hook.runner.release()
                hook._deactivate(caches.refused)
            self.refused_by_caches = caches.refused
            return False
        if self.refused_by_caches is not None:
            logger.info("%s: the hooks that kept graphs off are gone; graphs are used again", hook.name)
            self.refused_by_caches = None
            hook._reactivate()
        if changed:
            self._drop_graphs("the step caches on it changed", logging.INFO)
        hook.runner.key_extra = caches.key if caches.active else None
        hook.runner.state = caches if caches.active else None
        return True

    def undo_arrangement(self) -> None:
        if self.arranged is not None:
            self.arranged()
            self.arranged = None

    def _drop_graphs(self, why: str, level: int) -> int:
        hook = self.hook
        dropped = hook.runner.release(recapture=True)
        if dropped:
            logger.log(
                level, "%s: %s; dropped %d graphs, each is captured again on its next call", hook.name, why, dropped
            )
        return dropped
