"""One image on several GPUs: guidance branches on two ranks, Ulysses context parallelism, or both.

``accelerate_pipeline(pipe, parallel=...)`` in every process of a ``torchrun`` / ``accelerate
launch`` builds a :class:`ParallelSession`. It sets up collectively (:mod:`accel.parallel.setup`:
checks, agreement, the :class:`~accel.parallel.groups.Groups` its parts talk on), then installs
Ulysses and its hooks itself, beside :meth:`ParallelSession.restore`, which undoes them. Contract:

* Every rank calls it with the same options, its pipeline on its own device, and then makes the
  same pipeline calls (same prompts, resolution, steps and seed). Every rank returns the same
  image. A rank that disagrees (options, world size, model, a call's shapes, a warm-up plan)
  makes every rank raise one clear :class:`ParallelError` instead of hanging.
* Layouts (:mod:`accel.parallel.layout`): ``"cfg"`` needs 2 ranks; ``"ulysses"`` uses all N ranks
  as one Ulysses group; ``"cfg+ulysses"`` needs N = 2M ranks, M >= 2: a DeviceMesh ``(cfg=2,
  ring=1, ulysses=M)``, ranks ``[0, M)`` compute guidance branch 0 and ``[M, 2M)`` branch 1.
* CFG pairing (:mod:`accel.parallel.cfg_split`). Which denoiser call is which guidance branch is
  the recipe's knowledge (:meth:`Recipe.cfg_branch`, from the name of the diffusers
  ``cache_context`` the call runs under). A rank computes only its own branch, exactly as one GPU
  would, and the branches are exchanged before the pipeline combines them: bit-identical to one
  GPU. Branch calls stay outside graphs; a rank's graphs hold only its own branch's signatures.
* Ulysses (:mod:`accel.parallel.ulysses`): diffusers' ``enable_parallelism`` with the recipe's plan
  (:meth:`Recipe.context_parallel_plan`), calls first made splittable
  (:meth:`Recipe.prepare_context_parallel`), query, key and value in one all-to-all. Where the
  recipe joins a step's two guidance calls (:mod:`accel.hooks.cfg_batch`, whose hook sits
  outside this one), the joined call is what the group computes. The all-to-alls run inside
  graph segments; every rank of a Ulysses group captures the same signatures in the same order,
  and after any call that captured (or failed to) the group agrees on the outcome: if any rank
  failed, every rank drops that call's new graphs and runs it eagerly, so their collectives stay
  in step. :meth:`ParallelSession.restore` removes diffusers' parallel hooks and settings again.
* Agreement and liveness travel on gloo groups of their own with ``parallel_timeout_s``
  (:mod:`accel.parallel.agreement`): a digest of every denoiser call (shapes, branch, a call
  counter) is compared across ranks, before the call where ranks compute it together, at the
  exchange for guidance branches. A dead peer surfaces there as a :class:`ParallelError` on the
  survivors; a rank blocked behind a collective that will never complete is ended by a watchdog
  (:mod:`accel.parallel.process`). An exception that escapes a pipeline call outside these hooks
  (a callback's, say) leaves the watchdog armed: the ranks are out of step then, and the process
  ends the same way.
* Clean exit: graphs that hold collectives are released before the process group goes, at exit
  or when ``torch.distributed.destroy_process_group`` is called while a session lives (see
  :mod:`accel.parallel.process`); ``pipe.accel.shutdown()`` does it on demand.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from diffusers.hooks import HookRegistry

from ..hooks.components import module_device
from ..hooks.graph_hook import GraphHook
from ..hooks.options import AcceleratorOptions
from ..hooks.state.guard import CallGuard
from . import process
from .agreement import Agreement
from .cfg_split import PARALLEL_HOOK_NAME, ParallelHook, Router
from .errors import ParallelConfigError, ParallelError
from .groups import Groups
from .layout import Layout
from .process import Liveness
from .setup import Setup, set_up
from .ulysses import enable_ulysses

__all__ = ["PARALLEL_HOOK_NAME", "ParallelConfigError", "ParallelError", "ParallelSession"]

logger = logging.getLogger(__name__)


class ParallelSession:
    """The several-process side of one :class:`~accel.hooks.accelerator.PipelineAccelerator`.

    Built collectively (every rank of the launch, same options); see the module docstring.

    Attributes:
        groups: this rank's layout and process groups (:class:`~accel.parallel.groups.Groups`).
        timeout: ``parallel_timeout_s``.
        liveness: progress and what made the session unusable (a lost peer, say).
        router: where each denoiser call goes (:class:`~accel.parallel.cfg_split.Router`).
    """

    def __init__(
        self, pipe: Any, hooks: dict[str, GraphHook], guard: CallGuard | None, options: AcceleratorOptions
    ) -> None:
        assert options.parallel is not None
        self.options = options
        self.timeout = float(options.parallel_timeout_s)
        self._pipe_ref = weakref.ref(pipe)
        self.graph_hooks = dict(hooks)
        self.guard = guard
        self.undo: list[Callable[[], None]] = []
        self.groups = Groups(Layout(options.parallel, 1, 0, cfg=1, ulysses=1))  # until the process group says more
        self.liveness = Liveness(self.timeout)
        self.agreement = Agreement(self.liveness, lambda: self.groups.layout)
        self.router = Router(self.groups, self.agreement, self.liveness)
        self.device = module_device(getattr(pipe, next(iter(hooks))))
        try:
            plans = set_up(Setup(pipe, self.graph_hooks, guard, options, self.device), self.groups, self.agreement)
            self._install(pipe, plans)
        except BaseException:
            self.restore()
            raise

    def _install(self, pipe: Any, plans: dict[str, dict[str, Any]]) -> None:
        """Ulysses (with each denoiser's plan) and the parallel hooks; :meth:`restore` undoes them."""
        lay = self.layout
        for name, graph_hook in self.graph_hooks.items():
            module = getattr(pipe, name)
            if lay.ulysses > 1:
                self.undo.append(enable_ulysses(module, lay.ulysses, self.groups.mesh["ring", "ulysses"], plans[name]))
            hook = ParallelHook(self.router, name, graph_hook)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, PARALLEL_HOOK_NAME)
            self.hooks[name] = hook
        if self.guard is not None:
            r = self.router
            self.guard.listen(self, begin=r.begin_call, step=r.before_step, end=r.end_call)
        process.join(self)
        logger.info("%s", self.describe())

    @property
    def layout(self) -> Layout:
        """Which branch and Ulysses slot this rank has."""
        return self.groups.layout

    @property
    def hooks(self) -> dict[str, ParallelHook]:
        """The :class:`ParallelHook` of each denoiser (its ``computed`` and ``skipped`` branch calls)."""
        return self.router.hooks

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    def describe(self) -> str:
        """One line for reports."""
        lay = self.layout
        parts = [f"parallel {lay.parallel}: rank {lay.rank} of {lay.world}"]
        if lay.cfg > 1:
            parts.append(f"computes guidance branch {lay.branch}")
        if lay.ulysses > 1:
            parts.append(f"Ulysses slot {lay.ulysses_index} of {lay.ulysses}")
        counts = ", ".join(
            f"{n}: {h.computed} branch calls computed, {h.skipped} received" for n, h in self.hooks.items()
        )
        calls = f"{self.router.calls} denoiser calls, {self.router.exchanges} exchanges"
        parts.append(calls + (f" ({counts})" if counts else ""))
        unusable = self.liveness.broken or self.liveness.ended
        if unusable:
            parts.append(f"unusable: {unusable}")
        return "; ".join(parts)

    def check_same(self, what: str, lines: list[str]) -> None:
        """ParallelError on every rank unless every rank passes equal ``lines``."""
        self.liveness.require_usable()
        self.agreement.all_same(what, lines, group=self.groups.control)

    def release(self) -> None:
        """Drop every graph of this session's denoisers (they may hold collectives)."""
        for hook in self.graph_hooks.values():
            hook.runner.release()

    def restore(self) -> None:
        """Undo everything this session installed; the process group stays (see :meth:`shutdown`)."""
        live = self.liveness
        if live.closed:
            return
        live.closed = True
        process.leave(self)
        if self.guard is not None:
            self.guard.unlisten(self)
        pipe = self._pipe_ref()
        for name in reversed(list(self.hooks)):
            module = getattr(pipe, name, None) if pipe is not None else None
            registry = getattr(module, "_diffusers_hook", None)
            if isinstance(registry, HookRegistry) and PARALLEL_HOOK_NAME in registry.hooks:
                registry.remove_hook(PARALLEL_HOOK_NAME, recurse=False)
        self.hooks.clear()
        # Graphs may hold this session's collectives: gone before the parallel hooks they ran.
        if self.undo and live.broken is None:
            with contextlib.suppress(Exception):
                self.release()
        while self.undo:
            self.undo.pop()()
        groups = self.groups
        for group in (groups.ulysses_control, groups.control):
            if group is not None and live.broken is None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    process.unwrapped_destroy()(group)
        groups.control = groups.ulysses_control = None

    def shutdown(self) -> None:
        """:meth:`restore`, then destroy the default process group if a session created it."""
        self.restore()
        process.leave_process_group(broken=self.liveness.broken is not None)

    def process_group_destroyed(self) -> None:
        """The default process group is being destroyed: release the graphs first; unusable after."""
        if self.liveness.broken is None:
            with contextlib.suppress(Exception):
                self.release()
        self.liveness.ended = (
            "the process group was destroyed; call accelerate_pipeline(parallel=...) again after a new one"
        )
        self.liveness.in_pipeline_call = False
