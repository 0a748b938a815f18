"""The install: an :class:`~accel.hooks.plan.InstallPlan` put into a pipeline, layer by layer, and taken out again.

:class:`Installation` enters each layer once, in the plan's order; each layer entered puts what takes
it out again on one undo list, which :meth:`Installation.uninstall` runs last-in first-out (also
when an install fails half-way):

1. quantization: nothing to put in (``quantize=`` acts at the first warm-up); at uninstall it
   says what stays in float8; attention: the backend ``attention=`` sets on the denoisers'
   processors, before any graph hook watches them;
2. graph hooks: a :class:`~accel.hooks.graph_hook.GraphHook` on every planned module (one per
   module, shared by every pipeline that uses it), each capturing into this pipeline's pool on
   its device, so the decode's activations reuse the denoiser's;
3. the call guard: a :class:`~accel.hooks.state.guard.CallGuard` on the scheduler serialises calls and
   checks the denoisers' weights once per call (components check theirs as they are called); the
   denoisers' step caches hear where calls begin and end;
4. parallel: with ``parallel=`` one image is computed by several processes (a session from
   :mod:`accel.parallel`, which registers itself here: this layer never imports it); each rank
   runs the components (which hold no collectives) with its own graphs;
5. joined guidance branches (:mod:`accel.hooks.cfg_batch`) on the planned denoisers whose graphs
   are on, told how many Ulysses ranks share a call;
6. post-processing: where the plan found nothing against it, the pipeline's image processor makes
   ``output_type="pil"``'s pixels on the device (:mod:`accel.hooks.images.postprocess`), the same
   pixels bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..graphs.errors import BCGError
from ..graphs.pool import GraphPool
from .cfg_batch import CFGBatchHook, apply_cfg_batch, remove_cfg_batch
from .components import component
from .fp8.quantize import Quantization
from .graph_hook import GraphHook, apply_graph_runner, remove_graph_runner
from .images.postprocess import hook_postprocess
from .plan import InstallPlan
from .state.guard import CallGuard

__all__ = ["Installation", "ParallelSession", "register_parallel_session"]

logger = logging.getLogger(__name__)


class ParallelSession(Protocol):
    """What the accelerator asks of a several-process session (:class:`accel.parallel.ParallelSession`)."""

    layout: Any

    def check_same(self, what: str, lines: list[str]) -> None: ...

    def describe(self) -> str: ...

    def restore(self) -> None: ...

    def shutdown(self) -> None: ...


# accel.parallel sits above this layer, so this layer never imports it: importing it (accel's
# __init__ does) registers the session here.
_parallel_session: Callable[..., ParallelSession] | None = None


def register_parallel_session(factory: Callable[..., ParallelSession]) -> None:
    """Make ``factory(pipe, denoisers, guard, options)`` build the session for ``parallel=``."""
    global _parallel_session
    _parallel_session = factory


class Installation:
    """What one accelerator installed in one pipeline, by its plan; :meth:`uninstall` takes all of it out.

    Attributes:
        plan: what was planned (:class:`~accel.hooks.plan.InstallPlan`).
        hooks: the graph hook of each accelerated module, denoisers first, then components
            (text encoders, the VAE decoder), by component name.
        denoisers: the names of the denoisers among ``hooks``.
        guard: the scheduler's call guard (None where the pipeline has no scheduler to hook).
        parallel: the several-process session, or None.
        cfg_batch: the guidance-batching hook of each denoiser that has one.
        quantization: what ``quantize=`` does to the denoisers (:mod:`accel.hooks.fp8.quantize`),
            or None.
    """

    def __init__(self, pipe: Any, plan: InstallPlan) -> None:
        self.pipe = pipe
        self.plan = plan
        self.options = plan.options
        self.hooks: dict[str, GraphHook] = {}
        self.denoisers: list[str] = []
        self.guard: CallGuard | None = None
        self.parallel: ParallelSession | None = None
        self.cfg_batch: dict[str, CFGBatchHook] = {}
        self.quantization: Quantization | None = plan.quantization
        self._own_pool: GraphPool | None = None
        # The warm-ups' reports (accel.hooks.report.WarmupReport), for report()'s memory lines.
        self.warmups: list[Any] = []
        self.warmup_plans: list[Any] = []  # their plans: a later compile captures their cases again
        # What each layer entered takes out again, run last-in first-out by uninstall().
        self._undo: list[Callable[[], None]] = []
        if plan.parallel is not None and _parallel_session is None:
            raise BCGError("parallel= needs accel.parallel, which was not imported")
        try:
            if self.quantization is not None:
                self._undo.append(self.quantization.restore)
            self._enter_attention()
            self._enter_graph_hooks()
            self._enter_guard()
            self._enter_parallel()
            self._enter_cfg_batch()
            self._enter_postprocess()
        except BaseException:
            self.uninstall()
            raise

    # -- the layers, in order ----------------------------------------------------------------
    def _enter_attention(self) -> None:
        choice = self.plan.attention
        if choice is not None:
            denoisers = {m.name: m.module for m in self.plan.modules if not m.component}
            self._undo.append(choice.enter(denoisers))

    def _enter_graph_hooks(self) -> None:
        self._undo.append(self._leave_graph_hooks)
        for entry in self.plan.modules:
            self.hooks[entry.name] = apply_graph_runner(
                entry.module,
                self.options,
                name=entry.name,
                user=self,
                pool=self.pool_for(entry.device),
                component=entry.component,
                breaks=entry.breaks,
                offload_root=entry.offload_root,
                recipe=entry.recipe,
            )
            if not entry.component:
                self.denoisers.append(entry.name)

    def _leave_graph_hooks(self) -> None:
        for name in reversed(list(self.hooks)):
            module = component(self.pipe, name)
            if module is not None:
                remove_graph_runner(module, self)
        self.hooks.clear()
        self.denoisers.clear()

    def _enter_guard(self) -> None:
        if not self.plan.guard:
            return
        self.guard = CallGuard.attach(self.pipe, self, self._follow_weights)
        assert self.guard is not None
        self._undo.append(self._leave_guard)
        for name in self.denoisers:
            hook = self.hooks[name]
            hook.call_checks[id(self)] = weakref.WeakMethod(self._follow_scheduler)
            if hook.caches is not None:
                self.guard.listen(hook.caches, begin=hook.new_call, end=hook.caches.end_call)

    def _follow_scheduler(self) -> None:
        """At every denoiser call: ``pipe.scheduler = other`` leaves the guard on a scheduler the
        pipeline no longer calls, and nothing would be checked where calls start (a state change
        after it would replay stale graphs). The guard's duties move to the new scheduler, and
        this call, begun on it unguarded, begins now."""
        old = self.guard
        if old is None or getattr(self.pipe, "scheduler", None) is old.scheduler:
            return
        listeners: list[Any] = [h.caches for n in self.denoisers if (h := self.hooks[n]).caches is not None]
        listeners += [*self.cfg_batch.values(), *([self.parallel] if self.parallel is not None else [])]
        self.guard = old.hand_over(self.pipe, self, self._follow_weights, listeners)
        for hook in self.cfg_batch.values():
            hook.users[id(self)] = self.guard
        if self.parallel is not None:
            self.parallel.guard = self.guard
        if self.guard is None:
            logger.warning(
                "%s: the new scheduler (%s) has no set_timesteps to hook: calls are no longer checked; graphs are off",
                self.denoisers[0],
                type(getattr(self.pipe, "scheduler", None)).__name__,
            )
            for name in self.denoisers:
                self.hooks[name].runner.release(recapture=True)
                self.hooks[name].deactivate("the pipeline's scheduler cannot be hooked")
            return
        logger.info("%s: the pipeline has another scheduler; the call guard moved to it", self.denoisers[0])
        self.guard.begin()

    def _leave_guard(self) -> None:
        # self.guard, not the one entered: _follow_scheduler may have moved it since.
        if self.guard is not None:
            for name in self.denoisers:
                caches = self.hooks[name].caches
                if caches is not None:
                    self.guard.unlisten(caches)
            self.guard.detach(self)
            self.guard = None
        for name in self.denoisers:
            self.hooks[name].call_checks.pop(id(self), None)

    def _enter_parallel(self) -> None:
        if self.plan.parallel is None:
            return
        assert _parallel_session is not None
        # Collective: every rank of the launch builds its session here, or all fail.
        denoisers = {n: self.hooks[n] for n in self.denoisers}
        self.parallel = _parallel_session(self.pipe, denoisers, self.guard, self.options)
        self._undo.append(self._leave_parallel)

    def _leave_parallel(self) -> None:
        if self.parallel is not None:
            self.parallel.restore()
            self.parallel = None

    def _enter_cfg_batch(self) -> None:
        self._undo.append(self._leave_cfg_batch)
        degree = self.parallel.layout.ulysses if self.parallel is not None else 1
        for name in self.plan.cfg_batch:
            hook = self.hooks[name]
            if not hook.active:  # graphs off (an unsupported diffusers version, offloading): unchanged
                continue
            assert self.guard is not None
            caches = hook.caches
            self.cfg_batch[name] = apply_cfg_batch(
                getattr(self.pipe, name),
                hook.recipe,
                self.guard,
                name=name,
                user=self,
                degree=degree,
                # Step caches keep their state per guidance branch: the branches stay apart.
                paused=(lambda c=caches: c.present) if caches is not None else None,
            )

    def _leave_cfg_batch(self) -> None:
        for name in list(self.cfg_batch):
            remove_cfg_batch(getattr(self.pipe, name), self)
        self.cfg_batch.clear()

    def _enter_postprocess(self) -> None:
        if self.plan.postprocess_refused is None:
            # The patch is on the processor's instance dictionary; undoing it (or dropping the
            # pipeline, which collects it) gives the class's postprocess back.
            self._undo.append(hook_postprocess(self.pipe.image_processor).undo)

    def uninstall(self) -> None:
        """Take out everything, each layer in the reverse order it went in (also after an install
        that failed half way); the pipeline is as it was before, but for layers ``quantize=`` put
        in float8, which stay (see :mod:`accel.hooks.fp8.quantize`)."""
        while self._undo:
            self._undo.pop()()

    # -- what the accelerator asks -----------------------------------------------------------
    @property
    def primary(self) -> torch.nn.Module:
        """The first denoiser."""
        return getattr(self.pipe, self.denoisers[0])

    def pool_for(self, device: torch.device) -> GraphPool | None:
        """This pipeline's graph pool on ``device`` (None off CUDA): one pool per pipeline."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self._own_pool is None or self._own_pool.device.index != index:
            self._own_pool = GraphPool(device)
        return self._own_pool

    def why_no_graphs(self, device: torch.device) -> str | None:
        """Why nothing can be captured on ``device``, or None."""
        if not torch.cuda.is_available():
            return "CUDA is not available (graphs need a CUDA device)"
        if device.type != "cuda":
            return f"the denoiser is on {device}, not a CUDA device"
        reasons = {h.inactive_reason for h in self.hooks.values() if not h.active}
        if reasons and not any(h.active for h in self.hooks.values()):
            return "; ".join(sorted(r for r in reasons if r))
        return None

    def _follow_weights(self) -> None:
        # Per call, from the scheduler's set_timesteps: the denoisers. Components check
        # themselves as they are called (text encoders run before set_timesteps).
        for name in self.denoisers:
            self.hooks[name].follow_weights()
        if self.quantization is not None:
            self.quantization.note_call()
