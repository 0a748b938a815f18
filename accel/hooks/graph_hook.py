"""The diffusers hook that puts a graph runner into one module (a denoiser, a text encoder, a VAE decoder).

``apply_graph_runner(module, options)`` registers a :class:`GraphHook` in the module's diffusers
``HookRegistry`` (the way diffusers applies its own caches), so the module stays the module:
``.config``, ``.dtype``, ``cache_context`` and other hooks keep working. The hook owns its
recipe's lifecycle: :meth:`GraphHook.initialize_hook` installs the recipe (eager breaks, patched
helpers, compiled blocks) and :meth:`GraphHook.deinitalize_hook` undoes it, so removing the hook
gives the module back exactly as it was.

One module has one hook, and so one runner and one set of graphs, whichever pipelines call it:
pipelines built from another's components (``SomePipeline(**pipe.components)``,
``DiffusionPipeline.from_pipe``) share it. Each pipeline that uses the hook is counted as a user;
the last one to let go removes it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..graphs import discover
from ..graphs.pool import GraphPool
from ..graphs.runner import GraphRunner
from .caches import CacheBinding
from .caches.binding import is_registry_forward
from .caches.context import ContextProbe
from .compiled import compile as compile_mod
from .compiled.channel_norm import compile_channel_norms
from .compiled.fused import fuse_gelu_epilogues
from .compiled.group_norm import compile_group_norms
from .components import module_device
from .options import AcceleratorOptions
from .recipes.padding_gate import PaddingGate
from .recipes.recipe import Recipe
from .recipes.registry import new_recipe, version_supported
from .state.follow import Follower

__all__ = [
    "HOOK_NAME",
    "GraphHook",
    "apply_graph_runner",
    "check_joinable",
    "graph_hook_of",
    "remove_graph_runner",
]

logger = logging.getLogger(__name__)

HOOK_NAME = "bcg_graph_runner"


class GraphHook(ModelHook):
    """Routes a denoiser's forward through its recipe's call normalisation and a GraphRunner.

    Attributes:
        recipe: the model family's recipe.
        runner: the module's :class:`GraphRunner` (one per module).
        options: the options the hook was applied with (every user must agree on them).
        active: graphs may be used (not eager mode, a tested diffusers version, no offload).
        inactive_reason: why graphs are off, for reports (None while active).
        compiled: the repeated blocks were compiled by this hook.
        recompile_drops: how often a recompile dropped this module's graphs (compiled only).
        caches: the step caches found on a denoiser (None for a component).
    """

    # Stateful only so that diffusers tells it the current cache_context (the step caches' branch).
    _is_stateful = True

    def __init__(
        self,
        recipe: Recipe,
        options: AcceleratorOptions,
        name: str,
        *,
        component: bool = False,
        breaks: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.recipe = recipe
        self.options = options
        self.name = name
        self.component = component
        self.breaks = breaks
        # The module whose offload hooks move this one's weights, when it is a submodule.
        self.offload_root: weakref.ref[torch.nn.Module] | None = None
        self.runner = GraphRunner(
            self._recipe_forward,
            name=name,
            capture_on_miss=options.capture_on_miss,
            max_entries=options.max_entries,
            max_segments=options.max_segments,
            debug=options.mode == "debug",
            memory_budget=options.memory_budget_bytes,
            auto_breaks=options.auto_breaks,
            # A component's graphs stand in for code nobody wrote a recipe for: each is checked
            # against an eager run once, at capture.
            verify=component,
        )
        self.runner.state_types = frozenset(recipe.state_types)
        self.active = False
        self.inactive_reason: str | None = None
        self.compiled = False
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()
        self._module_ref: weakref.ref[torch.nn.Module] | None = None
        self._undo: list[Callable[[], None]] = []
        self._forward: Callable[..., Any] | None = None
        self.recipe_installed = False
        self.caches: CacheBinding | None = None
        self.context = ContextProbe()
        self.follower = Follower(self)
        # Set once removed: a wrapper someone put over this hook's forward may still call it,
        # and reaches the module's forward through ``_after_removal``.
        self._removed = False
        self._after_removal: Callable[[], Callable[..., Any] | None] = lambda: None
        # Run first at every call of a denoiser, by who installed it (the pipeline's scheduler
        # still the one the call guard hooks), keyed by installer; weak: the module must not
        # keep its pipeline's installation alive.
        self.call_checks: dict[int, weakref.WeakMethod[Callable[[], None]]] = {}
        self.padding = PaddingGate(name)
        # What removing the hook must undo beyond the registry's own bookkeeping.
        self._drop_registry = False
        self._drop_forward_attr = False

    # -- lifecycle (called by diffusers' HookRegistry) ---------------------------------------
    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._module_ref = weakref.ref(module)
        self.runner.capture_scope = lambda: self.recipe.capture_scope(module)
        ok, installed = version_supported(type(self.recipe))
        if self.options.mode == "eager":
            self.deactivate("mode eager")
        elif not ok:
            self.deactivate(
                f"the {self.recipe.name} recipe was tested with diffusers {self.recipe.diffusers_versions}, this is {installed}"
            )
            logger.warning("%s: %s; running %s eagerly", self.name, self.inactive_reason, type(module).__name__)
        else:
            self.active = True
            self.recipe_installed = True
            self._undo.append(self.recipe.install(module))
            for qualname in self.breaks:
                try:
                    self._undo.append(discover.mark_by_name(qualname))
                except ValueError as e:  # another transformers version: the capture will say what breaks
                    logger.info("%s: known break %s not marked: %s", self.name, qualname, e)
            if self.options.compile and not self.component:
                # Before the blocks compile: dynamo traces the forms in place then.
                forms = (
                    [fuse_gelu_epilogues(module), self.recipe.compiled_forms(module)]
                    if self.options.compiled_forms
                    else []
                )
                undo = compile_mod.compile_repeated_blocks(
                    module, self.name, self.options.compile_cache_dir, self.compile_options
                )
                if undo is not None:
                    self.compiled = True
                    self._undo.extend(forms)
                    self._undo.append(undo)
                else:  # not compiled (no CUDA, no repeated blocks): the stock forms stay
                    for form in reversed(forms):
                        form()
            elif self.options.compile and self.options.compiled_forms and module_device(module).type == "cuda":
                # A component (the VAE decoder) has no blocks to compile; its norms pay.
                # Compiled like blocks: traced with the same settings, its graphs dropped on a
                # recompile (see accel.hooks.state.follow), compiled by the warm-up before any capture.
                folder = self.options.compile_cache_dir
                undos = [u for u in (compile_group_norms(module, folder), compile_channel_norms(module, folder)) if u]
                self.compiled = bool(undos)
                self._undo.extend(undos)
        if not self.component:
            self.caches = CacheBinding(module, self.name, HOOK_NAME)
            self.caches.context_name = lambda: self.context.name
        self.follow_weights()
        return module

    @property
    def compile_options(self) -> dict[str, Any]:
        """``torch.compile``'s arguments for this module's blocks (with the user's inductor settings)."""
        return compile_mod.compile_options(self.options.inductor)

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        self._removed = True
        self.runner.release()
        self.runner.unmark()
        if self.caches is not None:
            self.caches.close()
        self.follower.undo_arrangement()
        self.follower.forget()
        while self._undo:
            self._undo.pop()()
        self._release_module()
        return module

    def _release_module(self) -> None:
        # The hook is a cycle of its own (its runner calls its bound method); while it also held
        # the module, a restored pipeline lived on until the collector ran, and its GPU memory
        # with it (a stock pipeline is freed by reference counting at ``del pipe``). The registry
        # has dropped its function reference; a wrapper over our forward may still call it, and
        # then reaches the module's forward through a weak method.
        original = self.fn_ref.original_forward if self.fn_ref is not None else None
        if inspect.ismethod(original):
            self._after_removal = weakref.WeakMethod(original)
        elif original is not None:
            self._after_removal = lambda o=original: o
        self.fn_ref = None
        self._forward = None
        self.runner.entry = None
        self.runner.capture_scope = None
        self.caches = None

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.context.set_context(None)
        return module

    # -- per call ----------------------------------------------------------------------------
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._removed:
            return self._after_removal()(*args, **kwargs)
        for ref in list(self.call_checks.values()):
            check = ref()
            if check is not None:
                check()
        if self.component:
            # A text encoder runs before the pipeline's per-call check (the scheduler's
            # set_timesteps), so a component checks its weights (offload, LoRA) as it is called.
            self.follow_weights()
        # Normalising calls (padding) only serves graph sharing: where nothing can be captured
        # the stock call runs untouched, so CPU results equal eager exactly.
        if self.active and module_device(module).type == "cuda":
            self._gate_padding(module)
            if self.recipe.padding_refused is None:
                args, kwargs = self.recipe.prepare(args, kwargs)
            args, kwargs = self.recipe.route_call(args, kwargs)
        # Before the runner runs: a capture it begins refuses the forward it stands for as a found
        # break, which it knows only once the forward is resolved.
        self._resolved_forward()
        captures = self.runner.counts.captures
        with contextlib.ExitStack() as stack:
            if self.caches is not None:
                stack.enter_context(self.caches.call_context())
            if self.compiled:
                stack.enter_context(compile_mod.tracing_settings())
            out = self.runner(*args, **kwargs)
        if self.runner.counts.captures != captures:
            self.follower.captured()
        return out

    def _recipe_forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolved_forward()(*args, **kwargs)

    def _resolved_forward(self) -> Callable[..., Any]:
        """The forward the runner calls, made on first use (the registry sets ``fn_ref`` after
        :meth:`initialize_hook`); ``runner.entry`` becomes the module's own forward with it."""
        if self._forward is None:
            # Decided by whether the recipe is installed, not by `active`: offloading switches
            # graphs off and on again, while prepare() may add what only the wrapper accepts.
            original = self.fn_ref.original_forward
            self.runner.entry = original
            self._forward = self.recipe.wrap_forward(original) if self.recipe_installed else original
        return self._forward

    def module(self) -> torch.nn.Module | None:
        """The hooked module (None before the hook is initialised, or once it is gone)."""
        return self._module_ref() if self._module_ref is not None else None

    def deactivate(self, reason: str) -> None:
        """Graphs off (every call runs eagerly), ``reason`` kept for reports."""
        self.active = False
        self.runner.enabled = False
        self.inactive_reason = reason

    def follow_weights(self) -> None:
        """Keep graphs in step with what they read: weights by address, and the Python state
        that decided what was captured (see :class:`Follower`)."""
        self.follower.follow()
        module = self.module()
        if module is not None:
            self._gate_padding(module)

    def _gate_padding(self, module: torch.nn.Module) -> None:
        """Let the recipe pad only while every attention processor takes its mask (see
        :class:`~accel.hooks.recipes.padding_gate.PaddingGate`)."""
        f = self.follower
        self.padding.look(self.recipe, module, (f.watch is not None, f.epoch, f.state))

    @property
    def recompile_drops(self) -> int:
        """How often a recompile dropped this module's graphs (compiled only)."""
        return self.follower.recompile_drops

    def reactivate(self) -> None:
        """Graphs on again."""
        self.active = True
        self.runner.enabled = True
        self.inactive_reason = None

    def new_call(self) -> None:
        """Where a pipeline call begins (after :meth:`follow_weights`)."""
        if self.caches is not None and self.caches.active:
            self.caches.new_call()
            self.runner.new_sequence()


def graph_hook_of(module: torch.nn.Module) -> GraphHook | None:
    """The module's :class:`GraphHook`, if it has one."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(HOOK_NAME) if registry is not None else None
    return hook if isinstance(hook, GraphHook) else None


def check_joinable(module: torch.nn.Module, options: AcceleratorOptions, name: str) -> GraphHook | None:
    """The module's graph hook if it has one made with ``options`` (None if it has none); a
    ValueError naming every option that differs where it was made with others: its graphs were
    made for those."""
    hook = graph_hook_of(module)
    if hook is not None and hook.options != options:
        diff = ", ".join(
            f"{f}={getattr(options, f)!r} (in use: {getattr(hook.options, f)!r})"
            for f in options.__dataclass_fields__
            if getattr(options, f) != getattr(hook.options, f)
        )
        raise ValueError(
            f"{name} ({type(module).__name__}) is already accelerated by another pipeline with other options: "
            f"{diff}; call restore() on that pipeline first or pass the same options"
        )
    return hook


def apply_graph_runner(
    module: torch.nn.Module,
    options: AcceleratorOptions,
    *,
    name: str,
    user: Any,
    pool: GraphPool | None,
    component: bool = False,
    breaks: tuple[str, ...] = (),
    offload_root: torch.nn.Module | None = None,
    recipe: Recipe | None = None,
) -> GraphHook:
    """Give ``module`` a graph runner (or join the one it has) on behalf of ``user``.

    A new runner captures into ``pool`` (None: the runner makes one on its first capture); a
    joined one keeps the pool it has. A ``component`` (a text encoder, a VAE decoder) gets the
    generic recipe, is never compiled, and each of its graphs is checked against eager once;
    ``breaks`` names functions (``module.qualname``) it runs as eager breaks; ``offload_root`` is
    the top-level component whose offload hooks move a submodule's weights (the VAE of its
    decoder). ``recipe``: the recipe a new hook gets (None: :func:`~accel.hooks.recipes.registry.new_recipe`'s).
    A module already accelerated with other options is refused (:func:`check_joinable`). Call
    :func:`remove_graph_runner` with the same ``user`` to let go.
    """
    hook = check_joinable(module, options, name)
    if hook is not None:
        hook.users.add(user)
        return hook
    if recipe is None:
        recipe = new_recipe(module, options, component=component)
    hook = GraphHook(recipe, options, name, component=component, breaks=breaks)
    if offload_root is not None and offload_root is not module:
        hook.offload_root = weakref.ref(offload_root)
    hook.runner.pool = pool
    hook._drop_registry = not hasattr(module, "_diffusers_hook")
    hook._drop_forward_attr = "forward" not in module.__dict__
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, HOOK_NAME)
    hook.users.add(user)
    logger.info("%s: %s with the %s recipe, mode %s", name, type(module).__name__, recipe.name, options.mode)
    return hook


def remove_graph_runner(module: torch.nn.Module, user: Any) -> bool:
    """Let go of ``module``'s runner for ``user``; the last user removes the hook. True if removed."""
    hook = graph_hook_of(module)
    if hook is None:
        return False
    hook.users.discard(user)
    if len(hook.users):
        return False
    registry = module._diffusers_hook
    # A forward someone wrapped over ours after we came (cache-dit's enable_cache does) stays: it
    # reaches the module's own forward through this hook, which passes calls through once removed.
    outer = module.__dict__.get("forward")
    wrapped_over = outer is not None and not is_registry_forward(outer)
    registry.remove_hook(HOOK_NAME, recurse=False)
    if wrapped_over:
        module.__dict__["forward"] = outer
        return True
    if hook._drop_registry and not registry.hooks:
        del module._diffusers_hook
    if hook._drop_forward_attr:
        module.__dict__.pop("forward", None)
    return True
