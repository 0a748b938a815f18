"""Fixed-address buffers for the tensors a step cache keeps from one step to the next.

A graph reads its inputs by address. A cache that stores last step's residual by assigning a new
tensor (``state.residual = out - h``) hands the next step's graph a tensor it was not captured
against; stored into a :class:`Slots` buffer instead (copied in place), the value moves and the
address stays. One buffer per owner, name, position in the stored structure, shape and dtype:
every resolution and guidance branch has its own, and none is ever freed while the slots live
(a graph may read it).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from ...graphs import tree

__all__ = ["Slots"]


class Slots:
    """Buffers by key; :meth:`store` copies a value's tensors into them and returns the value
    rebuilt around the buffers."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._buffers.values())

    def store(self, owner: Hashable, name: str, value: Any) -> Any:
        """``value`` with each tensor copied into its buffer (made on first sight, outside any
        graph memory: call it from an eager break or outside a capture)."""
        leaves, spec = tree.flatten(value)
        out = list(leaves)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            key = (owner, name, i, tuple(leaf.shape), leaf.dtype, leaf.device)
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = torch.empty_like(leaf, memory_format=torch.contiguous_format)
            if buf.data_ptr() != leaf.data_ptr():
                buf.copy_(leaf)
            out[i] = buf
        return tree.unflatten(out, spec)

    def snapshot(self) -> dict[Hashable, torch.Tensor]:
        return {k: v.clone() for k, v in self._buffers.items()}

    def restore(self, snapshot: dict[Hashable, torch.Tensor]) -> None:
        for k, v in snapshot.items():
            self._buffers[k].copy_(v)

    def clear(self) -> None:
        self._buffers.clear()
