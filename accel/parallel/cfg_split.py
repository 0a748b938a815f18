"""Where each denoiser call of a parallel run goes, and the exchange of guidance branches.

Every call of an accelerated denoiser reaches :meth:`Router.call` through the denoiser's
outermost hook (:class:`ParallelHook`). A call that is no guidance branch (or every call without
``cfg`` in the layout) is computed by every rank, after the ranks that compute it together
agreed on it. Under ``cfg`` a rank computes only its own branch, exactly as one GPU would; for
the other branch it returns at once an uncomputed buffer of the right structure
(:meth:`Recipe.cfg_output_like`). When both branches of a pair have been called (or before the
scheduler step, where a pipeline call without guidance made only one), each branch's output is
broadcast from the rank that computed it into the others' buffers, on the current stream, so
every rank holds both predictions before the pipeline combines them: bit-identical to one GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook

from ..graphs import tree
from ..hooks.caches.context import ContextProbe
from ..hooks.graph_hook import GraphHook
from . import ulysses
from .agreement import Agreement, describe_call, describe_value
from .errors import PREFIX, ParallelError
from .groups import Groups
from .process import Liveness

__all__ = ["PARALLEL_HOOK_NAME", "ParallelHook", "Router"]

PARALLEL_HOOK_NAME = "bcg_parallel"


@dataclasses.dataclass
class _Pair:
    """The guidance branches called since the last exchange: outputs, and each call's number and
    description (compared across ranks at the exchange)."""

    outputs: dict[int, Any] = dataclasses.field(default_factory=dict)
    calls: list[tuple[int, list[str]]] = dataclasses.field(default_factory=list)

    def clear(self) -> None:
        self.outputs.clear()
        self.calls.clear()


class ParallelHook(ModelHook):
    """Outermost hook of one denoiser in a parallel run: routes every call through the session's :class:`Router`.

    Stateful only so that diffusers tells it the current ``cache_context`` name.
    """

    _is_stateful = True

    def __init__(self, router: Router, name: str, graph_hook: GraphHook) -> None:
        super().__init__()
        self.router = router
        self.name = name
        self.graph_hook = graph_hook
        self.context = ContextProbe()
        self.pair = _Pair()
        self.computed = 0
        self.skipped = 0

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.context.set_context(None)
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.router.call(self, module, args, kwargs)


class Router:
    """The calls of one session's denoisers: who computes them, and the guidance exchange.

    Args:
        groups: the session's layout and groups (read at every call: set up after this is made).
        agreement: the session's comparisons and collectives.
        liveness: the session's progress, for the watchdog.

    Attributes:
        hooks: the :class:`ParallelHook` of each denoiser, by component name.
        calls: denoiser calls so far (every rank counts the same).
        exchanges: guidance exchanges so far.
    """

    def __init__(self, groups: Groups, agreement: Agreement, liveness: Liveness) -> None:
        self.groups = groups
        self.agreement = agreement
        self.liveness = liveness
        self.hooks: dict[str, ParallelHook] = {}
        self.calls = 0
        self.exchanges = 0

    # -- per pipeline call (the call guard's listeners) ------------------------------------------
    def begin_call(self) -> None:
        live = self.liveness
        live.in_pipeline_call = True
        live.stamp()
        for hook in self.hooks.values():
            hook.pair.clear()  # a call that raised mid-pair left it

    def end_call(self) -> None:
        self.liveness.in_pipeline_call = False

    def before_step(self) -> None:
        # Without guidance a pipeline call makes one branch per step: exchange it before the
        # scheduler reads it.
        try:
            for hook in self.hooks.values():
                self.exchange(hook)
        except BaseException:
            self.liveness.disarm()
            raise

    # -- per denoiser call ---------------------------------------------------------------------
    def call(self, hook: ParallelHook, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        g, live = self.groups, self.liveness
        live.require_usable()
        live.depth += 1
        live.stamp()
        try:
            lay = g.layout
            recipe = hook.graph_hook.recipe
            if lay.ulysses > 1:
                args, kwargs = recipe.prepare_context_parallel(module, args, kwargs, lay.ulysses)
            branch = recipe.cfg_branch(hook.context.name) if lay.cfg > 1 else None
            if branch not in (None, 0, 1):
                raise ParallelError(f"{PREFIX}: the {recipe.name} recipe named branch {branch!r}")
            desc = [f"{hook.name}, guidance branch {branch}", *describe_call(args, kwargs)]
            number = self.calls
            self.calls += 1
            if branch is None:
                # Every rank computes it (with collectives, under Ulysses): agree first.
                self.agreement.all_same(f"denoiser call {number}", desc, group=g.control, counter=number)
                self.exchange(hook)  # a pair in flight ends before an unpaired call
                return self._compute(hook, args, kwargs)
            if branch in hook.pair.outputs:
                self.exchange(hook)  # a new pair begins
            if branch == lay.branch:
                if g.ulysses_control is not None:
                    # Its Ulysses group computes it together: agree before their collectives.
                    self.agreement.all_same(f"denoiser call {number}", desc, group=g.ulysses_control, counter=number)
                out = self._compute(hook, args, kwargs)
                hook.computed += 1
            else:
                out = recipe.cfg_output_like(module, args, kwargs)
                hook.skipped += 1
            # The two branches' calls are compared across all ranks at the exchange, not here: a
            # rank must not wait for the other to finish launching its branch before it launches
            # its own (eager launching is host-bound).
            hook.pair.outputs[branch] = out
            hook.pair.calls.append((number, desc))
            if len(hook.pair.outputs) == lay.cfg:
                self.exchange(hook)
            return out
        except BaseException:
            # The pipeline call is over (errors here are symmetric: a recipe's ValueError, a
            # mismatch, a lost peer): the watchdog must not stay armed for it.
            live.disarm()
            raise
        finally:
            live.depth -= 1
            live.stamp()

    def _compute(self, hook: ParallelHook, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        g = self.groups
        runner = hook.graph_hook.runner
        agree = g.ulysses_control is not None and runner.enabled
        keys: set[Hashable] = set()
        blocked: set[Hashable] = set()
        if agree:
            before = runner.stats(memory=False)
            keys, blocked = set(runner.keys), set(runner.blocked)
        # The fused attention is swapped in for this call only: other models in the process
        # keep diffusers' own.
        fused = ulysses.fused_attention() if g.layout.ulysses > 1 else None
        try:
            out = hook.fn_ref.original_forward(*args, **kwargs)
        finally:
            if fused is not None:
                fused.undo()
        if agree:
            after = runner.stats(memory=False)
            if (after.captures, after.capture_failures) != (before.captures, before.capture_failures):
                ulysses.agree_on_capture(self.agreement, g.ulysses_control, runner, hook.name, keys, blocked)
        return out

    def exchange(self, hook: ParallelHook) -> None:
        """Broadcast each branch called since the last exchange from the rank that computed it."""
        g = self.groups
        pair = hook.pair
        if not pair.outputs:
            return
        outputs = sorted(pair.outputs.items())
        calls = list(pair.calls)
        pair.clear()
        # The calls, and the outputs: the buffers a rank made for the branch it did not compute
        # must match what the other rank computed, or the broadcast would misread memory.
        lines = [f"{line} (call {n})" for n, desc in calls for line in desc]
        lines += [line for b, out in outputs for line in describe_value(out, f"branch {b} output")]
        numbers = "-".join(dict.fromkeys((str(calls[0][0]), str(calls[-1][0]))))
        self.agreement.all_same(f"the guidance pair of denoiser calls {numbers}", lines, group=g.control)
        for branch, out in outputs:
            src = g.cfg_ranks[branch]
            for t in tree.tensors(out):
                if not t.is_contiguous():
                    raise ParallelError(f"{PREFIX}: {hook.name} returned a non-contiguous output; cannot exchange it")
                self.agreement.collective(
                    lambda t=t, src=src: dist.broadcast(t, src=src, group=g.cfg_group),
                    "exchanging guidance branches",
                )
        self.exchanges += 1
        self.liveness.stamp()
