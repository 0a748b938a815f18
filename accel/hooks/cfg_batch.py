"""Both guidance branches of a step in one batched denoiser call, on one GPU or one Ulysses group.

True-CFG pipelines (Qwen-Image) call the denoiser twice per step, the prompt then the negative
prompt, each at batch 1. At small resolutions such a call is bound by reading the weights and by
kernels too small to fill the GPU, so one call at batch 2 costs far less than two at batch 1.
:func:`apply_cfg_batch` puts a :class:`CFGBatchHook` outside a denoiser's graph hook. Contract:

* Which call is which branch is the recipe's knowledge (:meth:`Recipe.cfg_branch`, the same as for
  ``parallel="cfg"``): the pipeline must read neither branch's output before the second call.
* The first branch's call returns an uncomputed output of the right structure
  (:meth:`Recipe.cfg_output_like`). The second call joins both into one batch
  (:meth:`Recipe.batch_cfg`), runs it, fills the first output in place and returns its own half.
* Where the recipe cannot join them (shapes it will not pad to one, a call it does not know), the
  two run one after the other, unchanged. A first branch left alone (a call without guidance) is
  computed before the scheduler's step reads it, or before any other call; one left by a call that
  raised is dropped where the next pipeline call begins.
* Only inside a pipeline call (between the :class:`~accel.hooks.state.guard.CallGuard`'s begin and end): a
  denoiser called directly, under a ``cache_context`` or not, runs as it is. Pipelines that share
  the denoiser but not the scheduler each register their guard.
* What changes is the batch, not the arithmetic in real numbers: recipes join only calls already
  normalised to within bf16 noise of eager (Qwen-Image's padded text), never where the library
  promises bit-for-bit output.
* Under ``parallel="ulysses"`` the hook sits outside the :class:`~accel.parallel.cfg_split.ParallelHook`:
  the joined call is what every rank of the group computes together, and the recipe is told the
  group's size (``degree``), since each rank then computes a share of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..graphs import tree
from .caches.context import ContextProbe
from .recipes.recipe import Recipe, RecipeError
from .state.guard import CallGuard

__all__ = [
    "CFG_BATCH_HOOK_NAME",
    "CFGBatchHook",
    "apply_cfg_batch",
    "cfg_batch_hook_of",
    "remove_cfg_batch",
]

CFG_BATCH_HOOK_NAME = "bcg_cfg_batch"


class CFGBatchHook(ModelHook):
    """Outermost hook of a denoiser: holds the first guidance branch until the second comes.

    Stateful only so that diffusers tells it the current ``cache_context`` name.

    Attributes:
        degree: the Ulysses ranks each call is split over (1: one GPU); the recipe is told it.
        joined: pairs run as one batched call.
        alone: first branches run by themselves (no second came, or it could not join).
    """

    _is_stateful = True

    def __init__(self, recipe: Recipe, name: str, degree: int = 1, paused: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.recipe = recipe
        # True while the branches must stay apart (a step cache keeps state per branch).
        self.paused = paused
        self.name = name
        self.degree = degree
        self.context = ContextProbe()
        self._pending: tuple[tuple[Any, ...], dict[str, Any], Any] | None = None
        self._in_call = False
        # Who applied it (an accelerator's id) -> the guard of that accelerator's pipeline.
        self.users: dict[int, CallGuard] = {}
        self.joined = 0
        self.alone = 0

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.context.set_context(None)
        self._pending = None
        return module

    def begin(self) -> None:
        self._pending = None  # left by a call that raised: nobody reads it
        self._in_call = True

    def end(self) -> None:
        self.flush()
        self._in_call = False

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        if not self._in_call:  # nothing waits outside a call: end() flushed, begin() dropped
            return forward(*args, **kwargs)
        if self.paused is not None and self.paused():
            self.flush()
            return forward(*args, **kwargs)
        branch = self.recipe.cfg_branch(self.context.name)
        if branch == 1 and self._pending is not None:
            first_args, first_kwargs, first_out = self._pending
            self._pending = None
            # Joining pads both texts to one length: not while the processors would attend the padding.
            joined = (
                None
                if self.recipe.padding_refused is not None
                else self.recipe.batch_cfg(module, [(first_args, first_kwargs), (args, kwargs)], degree=self.degree)
            )
            if joined is None:
                self._fill(first_out, forward(*first_args, **first_kwargs))
                self.alone += 1
                return forward(*args, **kwargs)
            out = forward(*joined[0], **joined[1])
            halves = _split_batch(out, 2)
            self._fill(first_out, halves[0])
            self.joined += 1
            return halves[1]
        self.flush()
        if branch == 0:
            out = self.recipe.cfg_output_like(module, args, kwargs)
            self._pending = (args, kwargs, out)
            return out
        return forward(*args, **kwargs)

    def flush(self) -> None:
        """Compute a first branch still waiting for its pair (before anything reads it)."""
        if self._pending is None:
            return
        args, kwargs, out = self._pending
        self._pending = None
        self._fill(out, self.fn_ref.original_forward(*args, **kwargs))
        self.alone += 1

    def _fill(self, placeholder: Any, computed: Any) -> None:
        dst, src = tree.tensors(placeholder), tree.tensors(computed)
        if len(dst) != len(src) or any(d.shape != s.shape or d.dtype != s.dtype for d, s in zip(dst, src)):
            raise RecipeError(
                f"{self.name}: the {self.recipe.name} recipe described the first guidance branch's output as "
                f"{[(tuple(d.shape), d.dtype) for d in dst]} but the model returned "
                f"{[(tuple(s.shape), s.dtype) for s in src]}"
            )
        for d, s in zip(dst, src):
            d.copy_(s)


def _split_batch(out: Any, parts: int) -> list[Any]:
    """``out`` cut into ``parts`` equal slices along every tensor's batch dimension."""

    def cut(i: int) -> Any:
        def piece(t: torch.Tensor) -> torch.Tensor:
            size = t.shape[0] // parts
            return t[i * size : (i + 1) * size]

        return tree.map_tensors(piece, out)

    return [cut(i) for i in range(parts)]


def apply_cfg_batch(
    module: torch.nn.Module,
    recipe: Recipe,
    guard: CallGuard,
    *,
    name: str,
    user: Any,
    degree: int = 1,
    paused: Callable[[], bool] | None = None,
) -> CFGBatchHook:
    """Put a :class:`CFGBatchHook` on ``module`` (outside every hook it has) on behalf of
    ``user``, or join the one it has; it listens to ``guard`` (where calls begin and end, and
    before each scheduler step). ``degree``: the Ulysses ranks a call is split over, 1 on one
    GPU. ``paused``: while it returns True, calls pass through one by one. Undo with
    :func:`remove_cfg_batch` and the same ``user``."""
    hook = cfg_batch_hook_of(module)
    if hook is not None and hook.degree != degree:
        raise ValueError(
            f"{name}: its guidance branches are already joined for {hook.degree} Ulysses rank(s), not {degree}; "
            "restore() the other accelerator first"
        )
    if hook is None:
        hook = CFGBatchHook(recipe, name, degree, paused)
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, CFG_BATCH_HOOK_NAME)
    hook.users[id(user)] = guard
    guard.listen(hook, begin=hook.begin, step=hook.flush, end=hook.end)
    return hook


def cfg_batch_hook_of(module: torch.nn.Module) -> CFGBatchHook | None:
    """The module's :class:`CFGBatchHook`, if it has one."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(CFG_BATCH_HOOK_NAME) if registry is not None else None
    return hook if isinstance(hook, CFGBatchHook) else None


def remove_cfg_batch(module: torch.nn.Module, user: Any) -> None:
    """``user`` lets go of ``module``'s :class:`CFGBatchHook`; the last user takes it off."""
    hook = cfg_batch_hook_of(module)
    if hook is None or id(user) not in hook.users:
        return
    guard = hook.users.pop(id(user))
    if all(g is not guard for g in hook.users.values()):
        guard.unlisten(hook)
    if not hook.users:
        module._diffusers_hook.remove_hook(CFG_BATCH_HOOK_NAME, recurse=False)
