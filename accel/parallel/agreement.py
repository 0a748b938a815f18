"""What every rank must agree on, and how they compare it: digests on the session's gloo groups.

A call is described as lines (:func:`describe_call`: tensors by shape and dtype, literals by
value, other objects by type); every rank hashes its lines, one all-reduce compares the hashes,
and only where they differ are the lines gathered, so that the error names the first field that
differs. A collective that fails (a dead or hung peer, past ``parallel_timeout_s``) marks the
session broken (:class:`~accel.parallel.process.Liveness`) and raises :class:`ParallelError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..graphs import tree
from .errors import PREFIX, ParallelError
from .layout import Layout
from .process import Liveness

__all__ = ["Agreement", "describe_call", "describe_value", "digest"]

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


def digest(lines: list[str]) -> int:
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


class Agreement:
    """Comparisons and collectives of one session; a failure breaks the session (``liveness``).

    ``layout`` is read at every failure: it names the rank in the message.
    """

    def __init__(self, liveness: Liveness, layout: Callable[[], Layout]) -> None:
        self.liveness = liveness
        self.layout = layout

    def all_same(self, what: str, lines: list[str], *, group: Any, counter: int | None = None) -> None:
        """ParallelError on every rank of ``group`` unless every rank passes equal ``lines``."""
        keyed = lines if counter is None else [f"#{counter}", *lines]
        h = digest(keyed)
        t = torch.tensor([h, -h], dtype=torch.int64)
        self.collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), f"comparing {what}")
        if int(t[0]) == h and -int(t[1]) == h:
            self.liveness.stamp()
            return
        gathered: list[Any] = [None] * dist.get_world_size(group)
        self.collective(lambda: dist.all_gather_object(gathered, keyed, group=group), f"comparing {what}")
        self.liveness.disarm()
        raise ParallelError(
            f"{PREFIX}: {_first_difference(what, gathered)}; every rank must make the same calls "
            "(same prompts, resolution, steps, seed and options)"
        )

    def collective(self, fn: Callable[[], Any], what: str) -> None:
        """Run ``fn`` (a collective); a failure means a peer is lost: ParallelError, session broken."""
        try:
            fn()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            lay, live = self.layout(), self.liveness
            live.broken = (
                f"rank {lay.rank} of {lay.world} lost contact with the other ranks while {what} "
                f"({first}); a peer process has probably died or hung (parallel_timeout_s={live.timeout:g})"
            )
            live.disarm()
            raise ParallelError(f"{PREFIX}: {live.broken}") from exc
