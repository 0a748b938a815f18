"""Which rank computes what: guidance branches times Ulysses ranks (no process group needed)."""

from __future__ import annotations

import dataclasses

__all__ = ["Layout", "plan_layout"]


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
