"""A toy step cache (a FirstBlockCache in miniature) for tests of decisions under graphs.

It decides after its first "block" whether to compute the rest or reuse last step's residual,
with its decision an eager break and its state in fixed slots that graphs read and write.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.graphs.bcg import eager_on_graph


class ToyCache:
    """Counts its calls, decides on the first block's residual, keeps tensors in fixed slots."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.calls = 0
        self.computed = 0
        self.slots: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.prev: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None

    @eager_on_graph(decision=True)
    def decide(self, r: torch.Tensor) -> bool:
        self.calls += 1
        if self.prev is None:
            compute = True
        else:
            compute = bool(((r - self.prev).abs().mean() / self.prev.abs().mean()).item() > self.threshold)
        self.computed += compute
        return compute

    @eager_on_graph
    def store(self, name: str, t: torch.Tensor) -> None:
        slot = self.slots.get((name, tuple(t.shape)))
        if slot is None:
            slot = self.slots[(name, tuple(t.shape))] = torch.empty_like(t)
        slot.copy_(t)
        setattr(self, name, slot)

    # -- StepState -----------------------------------------------------------------------
    def snapshot(self) -> Any:
        return (self.calls, self.computed, self.prev, self.residual, {k: v.clone() for k, v in self.slots.items()})

    def restore(self, snap: Any) -> None:
        self.calls, self.computed, self.prev, self.residual, slots = snap
        for k, v in slots.items():
            self.slots[k].copy_(v)


def toy_forward(w: tuple[torch.Tensor, torch.Tensor]) -> Any:
    w0, w1 = w

    def forward(x: torch.Tensor, cache: ToyCache) -> torch.Tensor:
        h = torch.tanh(x @ w0)
        r = h - x
        if cache.decide(r):
            cache.store("prev", r)
            out = torch.tanh(h @ w1) + h
            cache.store("residual", out - h)
        else:
            out = h + cache.residual
        return out * 2

    return forward
