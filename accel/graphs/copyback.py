"""Copy-back of a break's replay output into its boundary buffer, and weak views of pool tensors.

Copy-back is strict (see :mod:`accel.graphs.bcg`): a different structure, shape, dtype or
constant raises :class:`~accel.graphs.errors.CopyBackError` naming the break and the field.
"""

from __future__ import annotations

from typing import Any

import torch

from . import tree
from .errors import CopyBackError

__all__ = ["PoolMap", "copy_into", "owned", "views_of_pool_tensors"]


def _same_constant(captured: Any, replayed: Any) -> bool:
    if captured is replayed:
        return True
    try:
        return bool(captured == replayed)
    except Exception:  # e.g. an array's elementwise ==: not a constant we can vouch for
        return False


def _leaf_mismatch(captured: Any, replayed: Any) -> str | None:
    """Why ``replayed`` cannot be copied into the captured leaf, or None if it can."""
    if isinstance(captured, torch.Tensor):
        if not isinstance(replayed, torch.Tensor):
            return f"expected a tensor, got {type(replayed).__name__}"
        if replayed.shape != captured.shape or replayed.dtype != captured.dtype or replayed.device != captured.device:
            return (
                f"captured {tuple(captured.shape)} {captured.dtype} on {captured.device}, "
                f"replay gave {tuple(replayed.shape)} {replayed.dtype} on {replayed.device}"
            )
        return None
    if type(replayed) is not type(captured):
        return f"captured a {type(captured).__name__}, replay gave a {type(replayed).__name__}"
    # A constant: the segments after this break were recorded with the captured value baked in.
    if not _same_constant(captured, replayed):
        return f"constant changed from {captured!r} to {replayed!r}"
    return None


def _structure_mismatch(dst: tree.Flat, leaves: list[Any], spec: tree.TreeSpec, root: str) -> str:
    """``path: why`` for the first place where a replay output's structure left the buffer's."""
    for step in tree.align(dst.spec, spec, root):
        if step.leaves:
            continue
        captured = dst.leaves[step.a_leaf] if step.a.is_leaf() else None
        if step.a.is_leaf() and isinstance(captured, torch.Tensor):
            got = type(leaves[step.b_leaf]).__name__ if step.b.is_leaf() else tree.type_name(step.b)
            return f"{step.path}: expected a tensor, got {got}"
        if step.a.is_leaf() or step.b.is_leaf() or tree.node_type(step.a) is not tree.node_type(step.b):
            was = type(captured).__name__ if step.a.is_leaf() else tree.type_name(step.a)
            now = type(leaves[step.b_leaf]).__name__ if step.b.is_leaf() else tree.type_name(step.b)
            return f"{step.path}: captured a {was}, replay gave a {now}"
        return f"{step.path}: {tree.describe_change(step.a, step.b)}"
    return f"{root}: structure changed"  # unreachable while align and spec_key agree


def copy_into(dst: tree.Flat, src: Any, break_name: str, root: str = "output") -> None:
    """Copy ``src`` into the flattened boundary buffer ``dst`` in place; strict (see the contract).

    Replay calls this once per break: the buffer was flattened at capture, only ``src`` is walked.
    """
    if dst.key is None and isinstance(src, torch.Tensor):
        leaves = [src]  # a bare leaf captured, a tensor back (the common case): no spec to build
    else:
        leaves, key = tree.flatten_key(src)
        if key != dst.key:
            why = _structure_mismatch(dst, leaves, tree.flatten(src)[1], root)
            raise CopyBackError(f"break {break_name!r}: {why}", src)
    for i, (d, s) in enumerate(zip(dst.leaves, leaves)):
        why = _leaf_mismatch(d, s)
        if why is not None:
            raise CopyBackError(f"break {break_name!r}: {root}{tree.leaf_paths(dst.spec)[i]}: {why}", src)
        if isinstance(d, torch.Tensor) and (s.data_ptr() != d.data_ptr() or s.stride() != d.stride()):
            d.copy_(s)


# --------------------------------------------------------------------------------------------
# Weak views of pool-resident break inputs
# --------------------------------------------------------------------------------------------
class PoolMap:
    """Which device addresses belong to one graph pool, from the caching allocator's snapshot.

    A break's inputs that a segment produced live in the graph pool. Holding them strongly would
    pin one activation per break and make graph memory grow with the number of breaks; a
    non-owning view of the same address is enough, because within a replay the producing segment
    writes it right before the break reads it, and every other writer of pool memory is a replay
    of some graph, which never runs concurrently with this one.
    """

    def __init__(self, pool: Any, device: torch.device) -> None:
        self.pool = tuple(pool) if pool is not None else None
        self.device = device
        self.ranges: list[tuple[int, int, bool]] = []

    def _refresh(self) -> None:
        segments = torch.cuda.memory._snapshot(self.device)["segments"]  # type: ignore[attr-defined]
        self.ranges = [
            (s["address"], s["address"] + s["total_size"], tuple(s.get("segment_pool_id", ())) == self.pool)
            for s in segments
            if s.get("device", self.device.index) == self.device.index
        ]

    def owns(self, t: torch.Tensor) -> bool:
        if self.pool is None or t.device.type != "cuda" or t.untyped_storage().nbytes() == 0:
            return False
        ptr = t.untyped_storage().data_ptr()
        for attempt in range(2):
            for lo, hi, in_pool in self.ranges:
                if lo <= ptr < hi:
                    return in_pool
            if attempt == 0:
                self._refresh()
        return False


def _weak_view(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(alias, t.storage_offset(), t.size(), t.stride())
    return out


def views_of_pool_tensors(obj: Any, pool_map: PoolMap) -> Any:
    """``obj`` with every tensor the graph pool owns replaced by a non-owning view of it.

    Walks ``obj`` as arguments are walked (:mod:`accel.graphs.tree`): containers, namedtuples and
    dataclasses are rebuilt around the views; plain objects are passed on as they are, so a
    tensor inside one stays strongly held. ``obj`` itself comes back when nothing was replaced.
    """
    leaves, spec = tree.flatten(obj, into_objects=False)
    views = [_weak_view(x) if type(x) is torch.Tensor and pool_map.owns(x) else x for x in leaves]
    if all(v is x for v, x in zip(views, leaves)):
        return obj
    return tree.unflatten(views, spec)


def owned(obj: Any) -> Any:
    """``obj`` with every tensor cloned (a break that keeps its inputs must not keep graph memory)."""
    return tree.map_tensors(lambda t: t.clone(), obj, into_objects=False)
