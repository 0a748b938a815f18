"""Compiled segments: a denoiser's repeated blocks compiled by inductor, then captured.

``compile_repeated_blocks`` is diffusers' regional compilation: every module whose class is in
the model's ``_repeated_blocks`` is compiled once with dynamic shapes, so one compile serves
every resolution, text length and batch. No cudagraph trees (inductor's default mode): the graphs
are ours, captured over the compiled kernels like over any others, and eager breaks between
blocks keep working.

Dynamo runs the newest compiled version whose guards pass for every shape, so a recompile (a new
shape) changes what older shapes compute too; graphs captured before it would replay the older
kernels. Warm-up therefore compiles every case before capturing any, and a recompile after that
drops the compiled graphs (:meth:`accel.hooks.graph_hook.GraphHook.follow_weights`); each is captured again on
its next call.

Compiled kernels persist in a cache folder (:func:`accel.hooks.options.default_compile_cache_dir`:
``$BCG_COMPILE_CACHE`` or ``~/.cache/bcg-diffusers/compile``), so a second process starts in
seconds. Deleting the folder clears it. A second process still traces every block with dynamo;
what it skips is AOTAutograd's and inductor's work, found in that folder. AOTAutograd's cache
refuses graphs that enter or leave an autocast region (Z-Image's rotary embedding turns autocast
off inside every block) unless those two functions are marked cacheable:
:func:`cache_autocast_regions` does that. And a compiled module's calls run under
:func:`tracing_settings`, so that dynamo's first attempt at a block is not thrown away and
sizes equal by chance at the first trace are not compiled in as equal; the blocks themselves are
called through :func:`calls_without_views`, so that the first block (given views) and the rest
share their compiled graphs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...graphs.patches import patch
from ..options import default_compile_cache_dir

__all__ = [
    "arrange_for_hooks",
    "cache_autocast_regions",
    "compile_options",
    "compile_repeated_blocks",
    "compiled_graph_count",
    "route_forwards",
    "tracing_settings",
    "use_compile_cache",
    "why_not_compiled",
]

logger = logging.getLogger(__name__)

COMPILE_OPTIONS: dict[str, Any] = dict(fullgraph=True, dynamic=True)
# Inductor settings of the compiled blocks, over inductor's defaults; the user's
# (``AcceleratorOptions.inductor``) go over these.
INDUCTOR_OPTIONS: dict[str, Any] = {}


# Versions dynamo may compile of one block's code during compiled calls (tracing_settings says why).
RECOMPILE_LIMIT = 64

# The library's post-grad pass (accel.hooks.compiled.same_calls), under this inductor setting.
PASS_SETTING = "post_grad_custom_pre_pass"


def compile_options(inductor: Any = None) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for the blocks: the library's pass
    (:class:`~accel.hooks.compiled.same_calls.SameCallsOnce`), the library's inductor settings
    and ``inductor`` (``(name, value)`` pairs or a mapping) over them; ValueError naming a
    setting inductor does not know."""
    if COMPILE_OPTIONS.get("backend", "inductor") != "inductor":  # settings are inductor's alone
        return dict(COMPILE_OPTIONS)
    from torch._inductor import list_options

    from .same_calls import SAME_CALLS_ONCE

    settings = {PASS_SETTING: SAME_CALLS_ONCE, **INDUCTOR_OPTIONS, **dict(inductor or ())}
    unknown = sorted(set(settings) - set(list_options()))
    if unknown:
        raise ValueError(f"inductor: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    return {**COMPILE_OPTIONS, "options": settings}


def use_compile_cache(folder: Path | None) -> tuple[Path, Callable[[], None]]:
    """Point inductor's (and Triton's) persistent caches at ``folder`` (the default if None)
    until the returned undo is called; returns the folder and the undo.

    Inductor reads its cache folder from the environment at every compile, so this takes effect
    for compiles that have not happened yet, and must stay while compiled blocks may still
    compile; a folder set by the user's own environment wins when ``folder`` is None, and a
    ``TRITON_CACHE_DIR`` of theirs always does.
    """
    theirs = _users_inductor_cache()
    if folder is None and theirs is not None:
        return Path(theirs), lambda: None
    folder = Path(folder) if folder is not None else default_compile_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    why = "the compile cache folder (compile=True)"
    held = [patch(os.environ, "TORCHINDUCTOR_CACHE_DIR", str(folder), why=why, where="item")]
    if "TRITON_CACHE_DIR" not in os.environ:
        held.append(patch(os.environ, "TRITON_CACHE_DIR", str(folder / "triton"), why=why, where="item"))
    return folder, lambda: [p.undo() for p in reversed(held)] and None


def _users_inductor_cache() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` where the user set it, else None. Importing dynamo (diffusers
    does) writes inductor's default folder (under the system's temporary folder) into the
    environment, and that was taken for the user's choice: the persistent cache then lived where a
    fresh container starts empty, and ``BCG_COMPILE_CACHE`` was never read."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it writes nothing there of its own
        return value
    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


# torch.amp's functions that dynamo puts into a graph for a ``with torch.autocast(...)`` block.
AUTOCAST_FUNCTIONS = ("_enter_autocast", "_exit_autocast")


def cache_autocast_regions() -> tuple[list[str], Callable[[], None]]:
    """Let AOTAutograd's persistent cache keep graphs with autocast regions until the returned
    undo is called; returns the names marked (none on a torch without these functions) and the
    undo.

    Without it a warm start re-runs AOTAutograd for every such graph (measured: docs/benchmarks.md;
    cold and warm outputs equal). Safe to cache: the region's device, dtype and on/off flag are arguments in the graph,
    hence in the cache key, and the mark is keyed by the torch version (inductor's documented
    ``unsafe_marked_cacheable_functions`` switch). Process-wide, like the cache folder.
    """
    import torch._inductor.config as inductor_config
    from torch.amp import autocast_mode

    marked = [f"{autocast_mode.__name__}.{n}" for n in AUTOCAST_FUNCTIONS if hasattr(autocast_mode, n)]
    table = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if not isinstance(table, dict) or len(marked) != len(AUTOCAST_FUNCTIONS):
        return [], lambda: None
    why = "autocast regions cacheable by AOTAutograd (compile=True)"
    held = [patch(table, name, torch.__version__, why=why, where="item") for name in marked]
    return marked, lambda: [p.undo() for p in reversed(held)] and None


@contextlib.contextmanager
def tracing_settings() -> Iterator[None]:
    """Dynamo settings for calls of a module whose blocks are compiled (where dynamo traces).

    * Floats specialised. With ``dynamic=True`` dynamo first makes every Python float a block
      reads (a norm's ``eps``) symbolic; inductor's pass that turns them into tensors gives up on
      the blocks of both models, and dynamo traces the block again with the floats as constants:
      each process traced its first block twice, warm cache or not. Specialising floats from the
      start gives those same constant floats at once (outputs bit-equal, a warm start faster:
      docs/benchmarks.md).
    * No duck sizing. Dynamo gives sizes that happen to be equal at the first trace one symbol
      and guards on the equality: at 1024x1024 Qwen-Image's 4096 image tokens equal the rows of
      its text RoPE table, so the next resolution with the same block variant (unpadded text:
      above 768x768 with the recipe, anywhere in the stock pipeline) failed that guard and
      compiled again (CPU inductor, tiny stock Qwen-Image at 1024, 768 and 512: 4 graphs -> 2).
    * Room for every variant. One block class compiles a version per variant its calls take
      (blocks with and without modulation or a text mask, batch 1 against larger batches), times
      the adapter states a server warms (no adapter, each LoRA or slot: peft's Python flags are
      guarded): tiny Z-Image with one LoRA took more than dynamo's default 8, and ``fullgraph``
      makes the ninth a failed warm-up. Each version costs warm-up time only (the calls after it
      replay graphs), so the limit is :data:`RECOMPILE_LIMIT`.

    Only for the duration of a call (the rest of the process keeps the defaults), through
    :mod:`accel.graphs.patches`, so calls in several threads put the defaults back whatever order
    they end in. Entered on every call of a compiled module, replays included.
    """
    why = "dynamo settings for a compiled module's call"
    limit = torch._dynamo.config.recompile_limit
    with (
        patch(torch._dynamo.config, "specialize_float", True, why=why),
        patch(torch.fx.experimental._config, "use_duck_shape", False, why=why),
        patch(torch._dynamo.config, "recompile_limit", max(RECOMPILE_LIMIT, limit), why=why),
    ):
        yield


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach() if value._base is not None else value
    if type(value) in (tuple, list):
        return type(value)(_detached(v) for v in value)
    return value


def calls_without_views(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` given its tensor arguments (also inside tuples and lists) as plain tensors where
    they are views: ``detach()`` keeps the memory, sizes and strides and drops the base.

    Dynamo guards on whether an input is a view, and on its base's sizes: a model's first block
    gets views (its embeddings), the blocks after it get the previous block's outputs, so every
    block variant compiled twice (CPU inductor, tiny models, three resolutions: Qwen-Image 4
    graphs -> 2, Z-Image 3 -> 2, outputs bit-equal). Blocks only read their inputs, so the
    aliasing the base records changes nothing. With autograd on, calls pass through as they are.
    """

    @functools.wraps(call)
    def without_views(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return call(*args, **kwargs)
        return call(*_detached(args), **{k: _detached(v) for k, v in kwargs.items()})

    return without_views


def route_forwards(
    module: torch.nn.Module,
    layers: list[torch.nn.Module],
    forward_for: Callable[[torch.nn.Module], Callable[..., Any]],
    cache_dir: Path | None,
    why: str,
    what: str,
) -> Callable[[], None] | None:
    """Give each of ``layers`` (``module``'s) the forward ``forward_for(layer)`` until the returned
    undo is called, the kernel cache in ``cache_dir`` (:func:`use_compile_cache`); None where there
    are none. ``what`` names the layers in the log line."""
    if not layers:
        return None
    _, forget_folder = use_compile_cache(cache_dir)
    held = [patch(m, "forward", forward_for(m), why=why, where="dict") for m in layers]
    logger.info("%s: %d %s through inductor", type(module).__name__, len(held), what)

    def undo() -> None:
        for p in reversed(held):
            p.undo()
        forget_folder()

    return undo


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def why_not_compiled(module: torch.nn.Module) -> str | None:
    """Why ``module``'s blocks would not be compiled (no CUDA, a module off the GPU, no repeated
    blocks declared), or None."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if not torch.cuda.is_available() or device.type != "cuda":
        return f"compile=True needs a CUDA device (the module is on {device})"
    classes = tuple(getattr(module, "_repeated_blocks", None) or ())
    if not hasattr(module, "compile_repeated_blocks") or not any(type(m).__name__ in classes for m in module.modules()):
        return f"{type(module).__name__} declares no repeated blocks to compile"
    return None


def compile_repeated_blocks(
    module: torch.nn.Module, name: str, cache_dir: Path | None, options: dict[str, Any] | None = None
) -> Callable[[], None] | None:
    """Compile ``module``'s repeated blocks in place with ``torch.compile(**options)`` (default
    :func:`compile_options`); returns the undo, or None if skipped.

    Skipped, with one message saying why, where compile cannot help or run: no CUDA, a module
    off the GPU, or a model that declares no repeated blocks.
    """
    why_not = why_not_compiled(module)
    if why_not is not None:
        logger.warning("%s: %s; not compiling", name, why_not)
        return None
    classes = tuple(getattr(module, "_repeated_blocks", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in classes]
    folder, forget_folder = use_compile_cache(cache_dir)
    _, unmark = cache_autocast_regions()
    previous = [m.__dict__.get("_compiled_call_impl") for m in blocks]
    module.compile_repeated_blocks(**(compile_options() if options is None else options))
    for m in blocks:
        m._compiled_call_impl = calls_without_views(m._compiled_call_impl)
    logger.info(
        "%s: compiling %d %s blocks with inductor (dynamic shapes) on first use; kernel cache in %s",
        name,
        len(blocks),
        "/".join(classes),
        folder,
    )

    def undo() -> None:
        for m, impl in zip(blocks, previous):
            m._compiled_call_impl = impl
        unmark()
        forget_folder()

    return undo


def _hooked(module: torch.nn.Module) -> Any:
    """``module``'s diffusers registry if it holds a hook that replaces the forward, else None."""
    registry = vars(module).get("_diffusers_hook")
    if registry is None or not registry._fn_refs or registry._fn_refs[0].original_forward is None:
        return None
    return registry


def arrange_for_hooks(module: torch.nn.Module, options: dict[str, Any] | None = None) -> Callable[[], None]:
    """Keep compiled blocks compilable under the hooks a step cache puts on or inside them.

    Compiling a block compiles its whole call, hooks included, with ``fullgraph=True``; a cache's
    decisions are eager breaks, which dynamo cannot hold. So, while the hooks are there:

    * a block that carries hooks itself (FirstBlockCache, MagCache) has its own forward compiled,
      beneath the hooks, which stay plain Python (captured by the graphs like any other code);
    * a block with hooked submodules (TaylorSeer's attention modules) is compiled with
      ``fullgraph=False``, so dynamo splits it at the breaks.

    Returns the undo (the blocks compiled as before). Blocks not compiled are left alone.
    """
    options = compile_options() if options is None else dict(options)
    undo: list[Callable[[], None]] = []
    classes = tuple(getattr(module, "_repeated_blocks", None) or ())
    for block in (m for m in module.modules() if type(m).__name__ in classes):
        compiled = vars(block).get("_compiled_call_impl")
        if compiled is None:
            continue
        registry = _hooked(block)
        if registry is not None:
            ref = registry._fn_refs[0]
            original = ref.original_forward
            ref.original_forward = calls_without_views(torch.compile(original, **options))
            block._compiled_call_impl = None
            undo.append(
                lambda b=block, c=compiled, r=ref, o=original: (
                    setattr(b, "_compiled_call_impl", c),
                    setattr(r, "original_forward", o),
                )
            )
        elif any(_hooked(m) is not None for m in block.modules() if m is not block):
            block._compiled_call_impl = calls_without_views(
                torch.compile(block._call_impl, **{**options, "fullgraph": False})
            )
            undo.append(lambda b=block, c=compiled: setattr(b, "_compiled_call_impl", c))

    def restore() -> None:
        while undo:
            undo.pop()()

    return restore
