"""One image on several GPUs: guidance branches on two ranks, Ulysses context parallelism, or both.

``accelerate_pipeline(pipe, parallel=...)`` in every process of a ``torchrun`` / ``accelerate
launch`` builds a :class:`ParallelSession`. Contract:

* Every rank calls it with the same options, its pipeline on its own device, and then makes the
  same pipeline calls (same prompts, resolution, steps and seed). Every rank returns the same
  image. A rank that disagrees (options, world size, model, a call's shapes, a warm-up plan)
  makes every rank raise one clear :class:`ParallelError` instead of hanging.
* Layouts (:class:`Layout`): ``"cfg"`` needs 2 ranks; ``"ulysses"`` uses all N ranks as one
  Ulysses group; ``"cfg+ulysses"`` needs N = 2M ranks, M >= 2: a DeviceMesh ``(cfg=2, ring=1,
  ulysses=M)``, ranks ``[0, M)`` compute guidance branch 0 and ``[M, 2M)`` branch 1, each half as
  one Ulysses group.
* CFG pairing. Which denoiser call is which guidance branch is the recipe's knowledge
  (:meth:`Recipe.cfg_branch`, from the name of the diffusers ``cache_context`` the call runs
  under; a stateful hook hears it the way diffusers' caches do). A rank computes only its own
  branch, exactly as one GPU would; for the other branch it returns at once an uncomputed buffer
  of the right structure (:meth:`Recipe.cfg_output_like`). When both branches of a pair have been
  called (or before the scheduler step, where a pipeline call without guidance made only one),
  each branch's output is broadcast from the rank that computed it into the others' buffers, on
  the current stream, so every rank holds both predictions before the pipeline combines them:
  bit-identical to one GPU. Branch calls stay outside graphs; a rank's graphs hold only its own
  branch's signatures.
* Ulysses: ``module.enable_parallelism(ContextParallelConfig(ulysses_degree=M, mesh=...))`` with
  the recipe's plan (:meth:`Recipe.context_parallel_plan`); calls are first made splittable
  (:meth:`Recipe.prepare_context_parallel`). Query, key and value travel in one all-to-all
  (:mod:`accel.parallel.ulysses`). Where the recipe joins a step's two guidance calls
  (:mod:`accel.hooks.cfg_batch`, whose hook sits outside this one), the joined call is what the group
  computes. The all-to-alls run inside graph segments. Every rank
  of a Ulysses group sees the same calls, so they capture the same signatures in the same order;
  after any call that captured (or failed to), the group agrees on the outcome (a gloo all-reduce)
  and, if any rank failed, every rank drops that call's new graphs and runs it eagerly, so their
  collectives stay in step. :meth:`close` (``restore()``) removes diffusers' parallel hooks and
  settings again: diffusers offers no ``disable_parallelism``, so the session undoes them itself.
* Agreement and liveness travel on gloo groups of their own with ``parallel_timeout_s``: a digest
  of every denoiser call (shapes, branch, a call counter) is compared across ranks, before the
  call where ranks compute it together, at the exchange for guidance branches (so no rank waits
  for another to launch its branch before launching its own). A dead peer surfaces there as a
  :class:`ParallelError` on the survivors. A rank whose host is blocked behind a collective that
  will never complete (a dead peer mid-kernel) is ended by a watchdog thread: no progress inside
  a pipeline call for ``parallel_timeout_s`` (+10 s) prints one line and exits the process with
  status 1. An exception that escapes a pipeline call outside these hooks (a callback's, say)
  leaves the watchdog armed: the ranks are out of step then, and the process ends the same way.
* Clean exit: graphs that hold collectives are released before the process group goes. An
  ``atexit`` handler does it (and destroys the process group where the session created it), and
  ``torch.distributed.destroy_process_group`` is wrapped to release them first while a session
  lives (a process group destroyed under live graphs hung the exit). ``pipe.accel.shutdown()``
  does it on demand. A session that lost a peer exits the process with status 1 at exit rather
  than wait on the dead peer.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook

from ..graphs import tree
from ..hooks.cfg_batch import ContextProbe
from ..hooks.graph_hook import GraphHook, module_device
from ..hooks.guard import CallGuard
from ..hooks.options import AcceleratorOptions
from . import ulysses

__all__ = [
    "PARALLEL_HOOK_NAME",
    "Layout",
    "ParallelConfigError",
    "ParallelError",
    "ParallelHook",
    "ParallelSession",
    "describe_call",
    "describe_value",
    "plan_layout",
]

logger = logging.getLogger(__name__)

PARALLEL_HOOK_NAME = "bcg_parallel"
# The watchdog gives a rank blocked in a gloo collective this long past the timeout to fail with
# gloo's own (clearer) error first.
WATCHDOG_GRACE_S = 10.0
_PREFIX = "bcg-diffusers parallel"


class ParallelError(RuntimeError):
    """The ranks of a parallel run disagree or lost contact; raised on every rank, one line."""


class ParallelConfigError(ParallelError, ValueError):
    """``accelerate_pipeline(parallel=...)`` cannot run with these options on these ranks."""


# --------------------------------------------------------------------------------------------
# Layout: which rank computes what
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``world`` ranks split one image: ``cfg`` guidance groups times ``ulysses`` ranks each.

    ``branch`` is the guidance branch this rank computes (0 with ``cfg == 1``), ``ulysses_index``
    its place in its Ulysses group. Rank ``r`` is ``branch * ulysses + ulysses_index``, the order
    of a row-major ``(cfg, ring=1, ulysses)`` DeviceMesh.
    """

    parallel: str
    world: int
    rank: int
    cfg: int
    ulysses: int

    @property
    def branch(self) -> int:
        return self.rank // self.ulysses

    @property
    def ulysses_index(self) -> int:
        return self.rank % self.ulysses

    def ulysses_groups(self) -> list[list[int]]:
        """The ranks of every Ulysses group, in mesh order."""
        return [[c * self.ulysses + u for u in range(self.ulysses)] for c in range(self.cfg)]

    def cfg_groups(self) -> list[list[int]]:
        """The ranks of every guidance pair (one rank per branch), in mesh order."""
        return [[c * self.ulysses + u for c in range(self.cfg)] for u in range(self.ulysses)]


def plan_layout(parallel: str, world: int, rank: int) -> Layout:
    """The layout of ``parallel`` over ``world`` ranks, or ValueError naming what to launch."""
    if parallel == "cfg":
        if world != 2:
            raise ValueError(
                f"parallel='cfg' runs the two guidance branches on 2 processes, this launch has {world}; "
                "use --nproc_per_node 2, or parallel='cfg+ulysses' for 4 or more"
            )
        return Layout(parallel, world, rank, cfg=2, ulysses=1)
    if parallel == "ulysses":
        if world < 2:
            raise ValueError("parallel='ulysses' needs 2 or more processes; this launch has 1")
        return Layout(parallel, world, rank, cfg=1, ulysses=world)
    if parallel == "cfg+ulysses":
        if world < 4 or world % 2:
            raise ValueError(
                f"parallel='cfg+ulysses' needs an even number of processes, at least 4 (2 x N/2), this launch has "
                f"{world}; use parallel='cfg' on 2"
            )
        return Layout(parallel, world, rank, cfg=2, ulysses=world // 2)
    raise ValueError(f"parallel must be one of cfg, ulysses, cfg+ulysses; got {parallel!r}")


# --------------------------------------------------------------------------------------------
# Call descriptions: what every rank must agree on
# --------------------------------------------------------------------------------------------
_LITERALS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _leaf_text(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"tensor{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
    if isinstance(leaf, _LITERALS):
        return repr(leaf)
    return type(leaf).__name__


def describe_value(value: Any, name: str = "value") -> list[str]:
    """``name[path]: leaf`` lines for a nested value: tensors by shape and dtype, literals by
    value, other objects by type. Device indices are left out (each rank has its own)."""
    leaves, spec = tree.flatten(value, into_objects=False)
    lines = [f"{name} structure: {tree.describe(spec)}"]
    for path, leaf in zip(tree.leaf_paths(spec), leaves):
        text = "device" if isinstance(leaf, torch.device) else _leaf_text(leaf)
        lines.append(f"{name}{path}: {text}")
    return lines


def describe_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """:func:`describe_value` lines of a call, by argument name."""
    lines = [line for i, a in enumerate(args) for line in describe_value(a, f"argument {i}")]
    return lines + [line for k, v in kwargs.items() for line in describe_value(v, k)]


def _digest(lines: list[str]) -> int:
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _first_difference(what: str, per_rank: list[Any]) -> str:
    """One line naming the first field that differs between rank 0 and another rank."""
    base = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        if other == base:
            continue
        if isinstance(base, list) and isinstance(other, list):
            for i in range(max(len(base), len(other))):
                a = base[i] if i < len(base) else "(nothing)"
                b = other[i] if i < len(other) else "(nothing)"
                if a != b:
                    return f"{what} differs across ranks: rank 0 has {a}, rank {rank} has {b}"
        return f"{what} differs across ranks: rank 0 has {base!r}, rank {rank} has {other!r}"
    return f"{what} differs across ranks"


# --------------------------------------------------------------------------------------------
# The hook on each denoiser
# --------------------------------------------------------------------------------------------
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
    """Outermost hook of one denoiser in a parallel run: routes every call through the session.

    Stateful only so that diffusers tells it the current ``cache_context`` name.
    """

    _is_stateful = True

    def __init__(self, session: ParallelSession, name: str, graph_hook: GraphHook) -> None:
        super().__init__()
        self.session = session
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
        return self.session._call(self, module, args, kwargs)


# --------------------------------------------------------------------------------------------
# Process-wide state: live sessions, the watchdog, exit handlers
# --------------------------------------------------------------------------------------------
_lock = threading.Lock()
_live: weakref.WeakSet[ParallelSession] = weakref.WeakSet()
_created_default_group = False
_installed = False
_original_destroy: Callable[..., Any] | None = None


def _sessions() -> list[ParallelSession]:
    with _lock:
        return list(_live)


def _hard_exit(message: str) -> None:
    """Print one line and end the process with status 1, without waiting on dead peers.

    Straight to stderr, not through logging: a configuration that silences this logger must
    not make the process vanish without a word.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    os._exit(1)


def _watchdog() -> None:
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        for s in _sessions():
            stalled = s._stalled_for(now)
            if stalled is not None and stalled > s.timeout + WATCHDOG_GRACE_S:
                _hard_exit(
                    f"{_PREFIX}: rank {s.rank} of {s.world}: no progress for {stalled:.0f}s inside a pipeline call "
                    f"(parallel_timeout_s={s.timeout:g}): another rank has probably died or hung; exiting"
                )


def _at_exit() -> None:
    sessions = _sessions()
    for s in sessions:
        if s._broken is not None:
            _hard_exit(f"{_PREFIX}: exiting without waiting for the other ranks: {s._broken}")
    for s in sessions:
        with contextlib.suppress(Exception):
            s.release_graphs()
    if _created_default_group and dist.is_initialized() and _original_destroy is not None:
        with contextlib.suppress(Exception):
            _original_destroy()


def _install_process_handlers() -> None:
    """Once per process: the watchdog thread, the exit handler, the destroy_process_group wrap."""
    global _installed, _original_destroy
    with _lock:
        if _installed:
            return
        _installed = True
    threading.Thread(target=_watchdog, name="bcg-parallel-watchdog", daemon=True).start()
    atexit.register(_at_exit)
    original = dist.destroy_process_group
    _original_destroy = original

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        # A process group destroyed while graphs holding its collectives live hung the exit.
        if group is None or group is dist.GroupMember.WORLD:
            for s in _sessions():
                s._process_group_destroyed()
        return original(group)

    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    from torch.distributed import distributed_c10d

    distributed_c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]


def _ensure_process_group(device: torch.device, timeout_s: float, parallel: str) -> None:
    """Join the launch's process group, creating it (with ``timeout_s``) if nobody has."""
    global _created_default_group
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "MASTER_ADDR" not in os.environ:
        raise ParallelConfigError(
            f"parallel={parallel!r} needs several processes: start the script with torchrun --nproc_per_node 2 "
            "or accelerate launch --num_processes 2 (this process runs alone)"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _created_default_group = True
    logger.info("joined a %s process group of %d ranks (timeout %gs)", backend, world, timeout_s)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------------------------
# Undoing diffusers' enable_parallelism
# --------------------------------------------------------------------------------------------
_MISSING = object()


def _enable_ulysses(module: torch.nn.Module, degree: int, mesh: Any, plan: dict[str, Any]) -> Callable[[], None]:
    """``module.enable_parallelism`` with ``plan``; returns what puts the module back exactly."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel

    subs = list(module.modules())
    had_registry = [m.__dict__.get("_diffusers_hook", _MISSING) for m in subs]
    had_forward = ["forward" in m.__dict__ for m in subs]
    processors = [getattr(m, "processor", None) for m in subs]
    had_config = [p.__dict__.get("_parallel_config", _MISSING) if p is not None else _MISSING for p in processors]
    module_config = module.__dict__.get("_parallel_config", _MISSING)
    try:
        module.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh), cp_plan=plan)
    except BaseException:
        _restore_parallel_state(module, subs, had_registry, had_forward, processors, had_config, module_config)
        raise
    _invalidate_child_registries(module)
    fused = ulysses.install()

    def undo() -> None:
        if fused:
            ulysses.uninstall()
        with contextlib.suppress(Exception):
            remove_context_parallel(module, plan)
        _restore_parallel_state(module, subs, had_registry, had_forward, processors, had_config, module_config)
        _invalidate_child_registries(module)

    return undo


def _invalidate_child_registries(module: torch.nn.Module) -> None:
    # diffusers caches which submodules carry hooks (for cache_context); ours came and went.
    registry = module.__dict__.get("_diffusers_hook")
    if isinstance(registry, HookRegistry) and hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()


def _restore_parallel_state(
    module: torch.nn.Module,
    subs: list[torch.nn.Module],
    had_registry: list[Any],
    had_forward: list[bool],
    processors: list[Any],
    had_config: list[Any],
    module_config: Any,
) -> None:
    for m, registry, forward in zip(subs, had_registry, had_forward):
        current = m.__dict__.get("_diffusers_hook")
        # Registries diffusers made for its split hooks, empty again: gone, with the forward
        # attribute they set (the module's own forward is the class's again).
        if registry is _MISSING and isinstance(current, HookRegistry) and not current.hooks:
            del m.__dict__["_diffusers_hook"]
            if not forward:
                m.__dict__.pop("forward", None)
    for p, before in zip(processors, had_config):
        if p is None:
            continue
        if before is _MISSING:
            p.__dict__.pop("_parallel_config", None)
        else:
            p.__dict__["_parallel_config"] = before
    if module_config is _MISSING:
        module.__dict__.pop("_parallel_config", None)
    else:
        module.__dict__["_parallel_config"] = module_config


# --------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------
class ParallelSession:
    """The several-process side of one :class:`~accel.hooks.accelerator.PipelineAccelerator`.

    Built collectively (every rank of the launch, same options); see the module docstring.

    Attributes:
        layout: which branch and Ulysses slot this rank has.
        timeout: ``parallel_timeout_s``.
    """

    def __init__(
        self, pipe: Any, hooks: dict[str, GraphHook], guard: CallGuard | None, options: AcceleratorOptions
    ) -> None:
        assert options.parallel is not None
        self.options = options
        self.timeout = float(options.parallel_timeout_s)
        self._pipe_ref = weakref.ref(pipe)
        self._graph_hooks = dict(hooks)
        self._guard = guard
        self._hooks: dict[str, ParallelHook] = {}
        self._undo: list[Callable[[], None]] = []
        self._broken: str | None = None
        self._ended: str | None = None
        self._closed = False
        self._calls = 0
        self._exchanges = 0
        self._in_pipeline_call = False
        self._depth = 0
        self._last_progress = time.monotonic()
        self.control: Any = None
        self.ulysses_control: Any = None
        self.cfg_group: Any = None
        self.cfg_ranks: list[int] = []
        self.mesh: Any = None
        module = getattr(pipe, next(iter(hooks)))
        self.device = module_device(module)
        try:
            self._setup(pipe)
        except BaseException:
            self.close()
            raise

    # -- public ------------------------------------------------------------------------------
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
            f"{n}: {h.computed} branch calls computed, {h.skipped} received" for n, h in self._hooks.items()
        )
        parts.append(f"{self._calls} denoiser calls, {self._exchanges} exchanges" + (f" ({counts})" if counts else ""))
        if self._broken or self._ended:
            parts.append(f"unusable: {self._broken or self._ended}")
        return "; ".join(parts)

    def check_same(self, what: str, lines: list[str]) -> None:
        """ParallelError on every rank unless every rank passes equal ``lines``."""
        self._require_usable()
        self._all_same(what, lines, group=self.control)

    def release_graphs(self) -> None:
        """Drop every graph of this session's denoisers (they may hold collectives)."""
        for hook in self._graph_hooks.values():
            hook.runner.release()

    def close(self) -> None:
        """Undo everything this session installed (``restore()``); the process group stays."""
        if self._closed:
            return
        self._closed = True
        with _lock:
            _live.discard(self)
        if self._guard is not None:
            self._guard.unlisten(self)
        pipe = self._pipe_ref()
        for name in reversed(list(self._hooks)):
            module = getattr(pipe, name, None) if pipe is not None else None
            registry = getattr(module, "_diffusers_hook", None)
            if isinstance(registry, HookRegistry) and PARALLEL_HOOK_NAME in registry.hooks:
                registry.remove_hook(PARALLEL_HOOK_NAME, recurse=False)
        self._hooks.clear()
        # Graphs may hold this session's collectives: gone before the parallel hooks they ran.
        if self._undo and self._broken is None:
            with contextlib.suppress(Exception):
                self.release_graphs()
        while self._undo:
            self._undo.pop()()
        for group in (self.ulysses_control, self.control):
            if group is not None and self._broken is None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    (_original_destroy or dist.destroy_process_group)(group)
        self.control = self.ulysses_control = None

    def leave_process_group(self) -> None:
        """Destroy the default process group if a session created it (after :meth:`close`)."""
        global _created_default_group
        self.close()
        if _created_default_group and dist.is_initialized() and not _sessions():
            if self._broken is None:
                (_original_destroy or dist.destroy_process_group)()
            _created_default_group = False

    # -- setup -------------------------------------------------------------------------------
    def _setup(self, pipe: Any) -> None:
        parallel = self.options.parallel
        assert parallel is not None
        self.layout = Layout(parallel, 1, 0, cfg=1, ulysses=1)  # until the process group says more
        _ensure_process_group(self.device, self.timeout, parallel)
        _install_process_handlers()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = Layout(parallel, world, rank, cfg=1, ulysses=1)  # until checked
        # A group of our own for agreement and liveness: host-side, gloo, our timeout, whatever
        # backend and timeout the launch's default group has. A rank that never asked for
        # parallel= never comes: the others fail here after the timeout.
        timeout = datetime.timedelta(seconds=self.timeout)
        groups: list[Any] = []
        self._collective(lambda: groups.append(dist.new_group(backend="gloo", timeout=timeout)), "joining them")
        self.control = groups[0]
        error: str | None = None
        plans: dict[str, dict[str, Any]] = {}
        try:
            self.layout = plan_layout(parallel, world, rank)
            plans = self._local_checks(pipe)
        except ValueError as exc:
            error = str(exc)
        self._agree_on_setup(pipe, error)
        self._build_groups()
        lay = self.layout
        for name, graph_hook in self._graph_hooks.items():
            module = getattr(pipe, name)
            if lay.ulysses > 1:
                self._undo.append(_enable_ulysses(module, lay.ulysses, self.mesh["ring", "ulysses"], plans[name]))
            hook = ParallelHook(self, name, graph_hook)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, PARALLEL_HOOK_NAME)
            self._hooks[name] = hook
        if self._guard is not None:
            self._guard.listen(self, begin=self._begin_call, step=self._before_step, end=self._end_call)
        with _lock:
            _live.add(self)
        logger.info("%s", self.describe())

    def _local_checks(self, pipe: Any) -> dict[str, dict[str, Any]]:
        """What this rank can check alone; ValueError (one line) where it cannot run."""
        lay = self.layout
        if self.device.type == "cuda" and self.device.index is None:
            raise ValueError("the denoiser is on 'cuda' without an index; move each rank's pipeline to cuda:LOCAL_RANK")
        if lay.cfg > 1 and self._guard is None:
            raise ValueError(f"parallel={lay.parallel!r} needs the pipeline's scheduler (where each step ends)")
        plans: dict[str, dict[str, Any]] = {}
        for name, hook in self._graph_hooks.items():
            module = getattr(pipe, name)
            if len(hook.users) > 1:
                raise ValueError(
                    f"{name} is shared with another accelerated pipeline; parallel= accelerates one pipeline per "
                    "denoiser (restore the other first)"
                )
            if getattr(module, "_parallel_config", None) is not None:
                raise ValueError(
                    f"{name} already has diffusers parallelism (enable_parallelism); pass parallel=None to keep "
                    "yours, or build the model without it"
                )
            if lay.cfg > 1:
                reason = hook.recipe.cfg_parallel_support(module)
                if reason is not None:
                    raise ValueError(f"parallel={lay.parallel!r} cannot split {name}: {reason}")
            if lay.ulysses > 1:
                plans[name] = hook.recipe.context_parallel_plan(module, lay.ulysses)
        return plans

    def _setup_facts(self, pipe: Any) -> dict[str, Any]:
        options = {f"option {k}": repr(v) for k, v in dataclasses.asdict(self.options).items()}
        options.pop("option compile_cache_dir", None)  # a per-machine path
        denoisers = {}
        for name, hook in self._graph_hooks.items():
            module = getattr(pipe, name)
            config = dict(getattr(module, "config", {}) or {})
            dtype = next((str(p.dtype) for p in module.parameters()), "-")
            denoisers[name] = (
                type(module).__name__,
                hook.recipe.name,
                f"config {_digest([repr(sorted((str(k), repr(v)) for k, v in config.items()))]):x}",
                dtype,
            )
        return {
            **options,
            "world size": dist.get_world_size(),
            "pipeline": type(pipe).__name__,
            "denoisers": repr(denoisers),
            "device type": self.device.type,
            "torch": torch.__version__,
            "diffusers": _version("diffusers"),
        }

    def _agree_on_setup(self, pipe: Any, error: str | None) -> None:
        """Every rank raises the same ParallelConfigError, or none does."""
        facts = self._setup_facts(pipe)
        where = (socket.gethostname(), str(self.device))
        gathered: list[Any] = [None] * dist.get_world_size()
        self._collective(
            lambda: dist.all_gather_object(gathered, (facts, where, error), group=self.control), "agreeing on options"
        )
        for rank, (_f, _w, err) in enumerate(gathered):
            if err is not None:
                raise ParallelConfigError(f"{_PREFIX}: rank {rank}: {err}")
        for key in facts:
            values = [f[key] for f, _w, _e in gathered]
            if any(v != values[0] for v in values):
                other = next(i for i, v in enumerate(values) if v != values[0])
                raise ParallelConfigError(
                    f"{_PREFIX}: the ranks disagree on {key}: rank 0 has {values[0]}, rank {other} has "
                    f"{values[other]}; every rank must call accelerate_pipeline with the same pipeline and options"
                )
        if self.device.type == "cuda":
            seen: dict[tuple[str, str], int] = {}
            for rank, (_f, w, _e) in enumerate(gathered):
                if w in seen:
                    raise ParallelConfigError(
                        f"{_PREFIX}: ranks {seen[w]} and {rank} both run on {w[1]} of {w[0]}; move each rank's pipeline "
                        "to its own GPU (pipe.to(f'cuda:{LOCAL_RANK}'))"
                    )
                seen[w] = rank

    def _build_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        lay = self.layout
        device_type = "cuda" if self.device.type == "cuda" else "cpu"
        self.mesh = init_device_mesh(device_type, (lay.cfg, 1, lay.ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        if lay.cfg > 1:
            self.cfg_group = self.mesh.get_group("cfg")
            self.cfg_ranks = dist.get_process_group_ranks(self.cfg_group)
            expected = lay.cfg_groups()[lay.ulysses_index]
            if self.cfg_ranks != expected:
                raise ParallelError(
                    f"{_PREFIX}: the device mesh put guidance pairs at {self.cfg_ranks}, not {expected}"
                )
        if lay.ulysses > 1:
            # Host-side twin of this rank's Ulysses group, for agreeing on captures; every rank
            # creates every group, in the same order.
            timeout = datetime.timedelta(seconds=self.timeout)
            for ranks in lay.ulysses_groups():
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if lay.rank in ranks:
                    self.ulysses_control = group

    # -- per pipeline call ---------------------------------------------------------------------
    def _begin_call(self) -> None:
        self._in_pipeline_call = True
        self._stamp()
        for hook in self._hooks.values():
            hook.pair.clear()  # a call that raised mid-pair left it

    def _end_call(self) -> None:
        self._in_pipeline_call = False

    def _before_step(self) -> None:
        # Without guidance a pipeline call makes one branch per step: exchange it before the
        # scheduler reads it.
        try:
            for hook in self._hooks.values():
                self._exchange(hook)
        except BaseException:
            self._disarm()
            raise

    # -- per denoiser call ---------------------------------------------------------------------
    def _call(self, hook: ParallelHook, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._require_usable()
        self._depth += 1
        self._stamp()
        try:
            lay = self.layout
            if lay.ulysses > 1:
                args, kwargs = hook.graph_hook.recipe.prepare_context_parallel(module, args, kwargs, lay.ulysses)
            branch = hook.graph_hook.recipe.cfg_branch(hook.context.name) if lay.cfg > 1 else None
            if branch not in (None, 0, 1):
                raise ParallelError(f"{_PREFIX}: the {hook.graph_hook.recipe.name} recipe named branch {branch!r}")
            desc = [f"{hook.name}, guidance branch {branch}", *describe_call(args, kwargs)]
            number = self._calls
            self._calls += 1
            if branch is None:
                # Every rank computes it (with collectives, under Ulysses): agree first.
                self._all_same(f"denoiser call {number}", desc, group=self.control, counter=number)
                self._exchange(hook)  # a pair in flight ends before an unpaired call
                return self._compute(hook, args, kwargs)
            if branch in hook.pair.outputs:
                self._exchange(hook)  # a new pair begins
            if branch == lay.branch:
                if self.ulysses_control is not None:
                    # Its Ulysses group computes it together: agree before their collectives.
                    self._all_same(f"denoiser call {number}", desc, group=self.ulysses_control, counter=number)
                out = self._compute(hook, args, kwargs)
                hook.computed += 1
            else:
                out = hook.graph_hook.recipe.cfg_output_like(module, args, kwargs)
                hook.skipped += 1
            # The two branches' calls are compared across all ranks at the exchange, not here: a
            # rank must not wait for the other to finish launching its branch before it launches
            # its own (eager launching is host-bound).
            hook.pair.outputs[branch] = out
            hook.pair.calls.append((number, desc))
            if len(hook.pair.outputs) == lay.cfg:
                self._exchange(hook)
            return out
        except BaseException:
            # The pipeline call is over (errors here are symmetric: a recipe's ValueError, a
            # mismatch, a lost peer): the watchdog must not stay armed for it.
            self._disarm()
            raise
        finally:
            self._depth -= 1
            self._stamp()

    def _compute(self, hook: ParallelHook, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = hook.graph_hook.runner
        agree = self.ulysses_control is not None and runner.enabled
        if agree:
            before = runner.stats(memory=False)
            keys = set(runner.keys)
            blocked = set(runner.blocked)
        out = hook.fn_ref.original_forward(*args, **kwargs)
        if agree:
            after = runner.stats(memory=False)
            if (after.captures, after.capture_failures) != (before.captures, before.capture_failures):
                self._agree_on_capture(hook, keys, blocked)
        return out

    def _agree_on_capture(self, hook: ParallelHook, keys: set[Hashable], blocked: set[Hashable]) -> None:
        """After a call that captured (or failed to) on this Ulysses group: all keep it or none."""
        runner = hook.graph_hook.runner
        new = [k for k in runner.keys if k not in keys]
        failed = [k for k in runner.blocked if k not in blocked]
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        self._collective(
            lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ulysses_control), "agreeing on a capture"
        )
        if not int(flag.item()):
            return
        if new:
            runner.block(
                new,
                "another rank failed to capture this call; every rank runs it eagerly (collectives in step)",
            )
        logger.warning(
            "%s: a capture failed on %s; every rank of its Ulysses group runs that call eagerly",
            hook.name,
            "this rank" if failed else "another rank",
        )

    def _exchange(self, hook: ParallelHook) -> None:
        """Broadcast each branch called since the last exchange from the rank that computed it."""
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
        self._all_same(f"the guidance pair of denoiser calls {numbers}", lines, group=self.control)
        for branch, out in outputs:
            src = self.cfg_ranks[branch]
            for t in tree.tensors(out):
                if not t.is_contiguous():
                    raise ParallelError(f"{_PREFIX}: {hook.name} returned a non-contiguous output; cannot exchange it")
                self._collective(
                    lambda t=t, src=src: dist.broadcast(t, src=src, group=self.cfg_group),
                    "exchanging guidance branches",
                )
        self._exchanges += 1
        self._stamp()

    # -- agreement primitives ------------------------------------------------------------------
    def _all_same(self, what: str, lines: list[str], *, group: Any, counter: int | None = None) -> None:
        keyed = lines if counter is None else [f"#{counter}", *lines]
        h = _digest(keyed)
        t = torch.tensor([h, -h], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), f"comparing {what}")
        if int(t[0]) == h and -int(t[1]) == h:
            self._stamp()
            return
        gathered: list[Any] = [None] * dist.get_world_size(group)
        self._collective(lambda: dist.all_gather_object(gathered, keyed, group=group), f"comparing {what}")
        self._disarm()
        raise ParallelError(
            f"{_PREFIX}: {_first_difference(what, gathered)}; every rank must make the same calls "
            "(same prompts, resolution, steps, seed and options)"
        )

    def _collective(self, fn: Callable[[], Any], what: str) -> None:
        try:
            fn()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            self._broken = (
                f"rank {self.layout.rank} of {self.layout.world} lost contact with the other ranks while {what} "
                f"({first}); a peer process has probably died or hung (parallel_timeout_s={self.timeout:g})"
            )
            self._disarm()
            raise ParallelError(f"{_PREFIX}: {self._broken}") from exc

    # -- liveness ------------------------------------------------------------------------------
    def _stamp(self) -> None:
        self._last_progress = time.monotonic()

    def _disarm(self) -> None:
        self._in_pipeline_call = False
        self._stamp()

    def _stalled_for(self, now: float) -> float | None:
        """Seconds without progress while a call is in flight on this rank, else None."""
        if self._closed or self._broken is not None or not (self._in_pipeline_call or self._depth):
            return None
        return now - self._last_progress

    def _require_usable(self) -> None:
        if self._broken is not None:
            raise ParallelError(f"{_PREFIX}: this run cannot continue: {self._broken}")
        if self._ended is not None:
            raise ParallelError(f"{_PREFIX}: {self._ended}")
        if self._closed:
            raise ParallelError(f"{_PREFIX}: this session was closed (restore); call accelerate_pipeline again")

    def _process_group_destroyed(self) -> None:
        if self._broken is None:
            with contextlib.suppress(Exception):
                self.release_graphs()
        self._ended = "the process group was destroyed; call accelerate_pipeline(parallel=...) again after a new one"
        self._in_pipeline_call = False
