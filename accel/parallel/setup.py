"""What a parallel session does once, collectively, before it installs anything.

Every rank checks what it can alone (its device, the denoisers' recipes, diffusers' own
parallelism), then every rank gathers every rank's facts (options, world size, model, versions,
where it runs) and every rank raises the same :class:`ParallelConfigError`, or none does. Then
the groups are built (a DeviceMesh ``(cfg, ring=1, ulysses)``, gloo twins of the Ulysses groups
for agreeing on captures) into the session's :class:`~accel.parallel.groups.Groups`. What the
session installs with them (Ulysses, each denoiser's
:class:`~accel.parallel.cfg_split.ParallelHook`) it installs itself, beside its undo.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import socket
from typing import Any

import torch
import torch.distributed as dist

from ..hooks.graph_hook import GraphHook
from ..hooks.options import AcceleratorOptions
from ..hooks.state.guard import CallGuard
from .agreement import Agreement, digest
from .errors import PREFIX, ParallelConfigError, ParallelError
from .groups import Groups
from .layout import Layout, plan_layout
from .process import ensure_process_group

__all__ = ["Setup", "set_up"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a session sets up from: its pipeline and denoisers, as every rank must agree on them.

    Attributes:
        pipe: the pipeline.
        hooks: the graph hook of each denoiser, by component name.
        guard: the scheduler's call guard (None without a scheduler).
        options: the accelerator's options (``parallel`` is set).
        device: where this rank's denoisers run.
    """

    pipe: Any
    hooks: dict[str, GraphHook]
    guard: CallGuard | None
    options: AcceleratorOptions
    device: torch.device


def set_up(s: Setup, groups: Groups, agreement: Agreement) -> dict[str, dict[str, Any]]:
    """Check, agree and build ``groups`` (see the module), collectively; returns each denoiser's
    Ulysses plan (empty without Ulysses). Raises the same error on every rank, or none."""
    parallel = s.options.parallel
    assert parallel is not None
    timeout_s = float(s.options.parallel_timeout_s)
    groups.layout = Layout(parallel, 1, 0, cfg=1, ulysses=1)  # until the process group says more
    ensure_process_group(s.device, timeout_s, parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups.layout = Layout(parallel, world, rank, cfg=1, ulysses=1)  # until checked
    # A group of our own for agreement and liveness: host-side, gloo, our timeout, whatever
    # backend and timeout the launch's default group has. A rank that never asked for
    # parallel= never comes: the others fail here after the timeout.
    timeout = datetime.timedelta(seconds=timeout_s)
    joined: list[Any] = []
    agreement.collective(lambda: joined.append(dist.new_group(backend="gloo", timeout=timeout)), "joining them")
    groups.control = joined[0]
    error: str | None = None
    plans: dict[str, dict[str, Any]] = {}
    try:
        groups.layout = plan_layout(parallel, world, rank)
        plans = _local_checks(s, groups.layout)
    except ValueError as exc:
        error = str(exc)
    _agree_on_setup(s, agreement, groups.control, error)
    _build_groups(groups, s.device, timeout)
    return plans


def _local_checks(s: Setup, lay: Layout) -> dict[str, dict[str, Any]]:
    """What this rank can check alone; ValueError (one line) where it cannot run."""
    if s.device.type == "cuda" and s.device.index is None:
        raise ValueError("the denoiser is on 'cuda' without an index; move each rank's pipeline to cuda:LOCAL_RANK")
    if lay.cfg > 1 and s.guard is None:
        raise ValueError(f"parallel={lay.parallel!r} needs the pipeline's scheduler (where each step ends)")
    plans: dict[str, dict[str, Any]] = {}
    for name, hook in s.hooks.items():
        module = getattr(s.pipe, name)
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


def _setup_facts(s: Setup) -> dict[str, Any]:
    options = {f"option {k}": repr(v) for k, v in dataclasses.asdict(s.options).items()}
    options.pop("option compile_cache_dir", None)  # a per-machine path
    denoisers = {}
    for name, hook in s.hooks.items():
        module = getattr(s.pipe, name)
        config = dict(getattr(module, "config", {}) or {})
        dtype = next((str(p.dtype) for p in module.parameters()), "-")
        denoisers[name] = (
            type(module).__name__,
            hook.recipe.name,
            f"config {digest([repr(sorted((str(k), repr(v)) for k, v in config.items()))]):x}",
            dtype,
        )
    return {
        **options,
        "world size": dist.get_world_size(),
        "pipeline": type(s.pipe).__name__,
        "denoisers": repr(denoisers),
        "device type": s.device.type,
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
    }


def _agree_on_setup(s: Setup, agreement: Agreement, control: Any, error: str | None) -> None:
    """Every rank raises the same ParallelConfigError, or none does."""
    facts = _setup_facts(s)
    where = (socket.gethostname(), str(s.device))
    gathered: list[Any] = [None] * dist.get_world_size()
    agreement.collective(
        lambda: dist.all_gather_object(gathered, (facts, where, error), group=control), "agreeing on options"
    )
    for rank, (_f, _w, err) in enumerate(gathered):
        if err is not None:
            raise ParallelConfigError(f"{PREFIX}: rank {rank}: {err}")
    for key in facts:
        values = [f[key] for f, _w, _e in gathered]
        if any(v != values[0] for v in values):
            other = next(i for i, v in enumerate(values) if v != values[0])
            raise ParallelConfigError(
                f"{PREFIX}: the ranks disagree on {key}: rank 0 has {values[0]}, rank {other} has "
                f"{values[other]}; every rank must call accelerate_pipeline with the same pipeline and options"
            )
    if s.device.type == "cuda":
        seen: dict[tuple[str, str], int] = {}
        for rank, (_f, w, _e) in enumerate(gathered):
            if w in seen:
                raise ParallelConfigError(
                    f"{PREFIX}: ranks {seen[w]} and {rank} both run on {w[1]} of {w[0]}; move each rank's pipeline "
                    "to its own GPU (pipe.to(f'cuda:{LOCAL_RANK}'))"
                )
            seen[w] = rank


def _build_groups(g: Groups, device: torch.device, timeout: datetime.timedelta) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    lay = g.layout
    device_type = "cuda" if device.type == "cuda" else "cpu"
    g.mesh = init_device_mesh(device_type, (lay.cfg, 1, lay.ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
    if lay.cfg > 1:
        g.cfg_group = g.mesh.get_group("cfg")
        g.cfg_ranks = dist.get_process_group_ranks(g.cfg_group)
        expected = lay.cfg_groups()[lay.ulysses_index]
        if g.cfg_ranks != expected:
            raise ParallelError(f"{PREFIX}: the device mesh put guidance pairs at {g.cfg_ranks}, not {expected}")
    if lay.ulysses > 1:
        # Host-side twin of this rank's Ulysses group, for agreeing on captures; every rank
        # creates every group, in the same order.
        for ranks in lay.ulysses_groups():
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if lay.rank in ranks:
                g.ulysses_control = group


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
