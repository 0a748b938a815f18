"""Which rank computes what: guidance branches times Ulysses ranks (no process group needed).

Standard library only, and nothing else of accel: ``bcg-serve --ray`` loads this file on its own
to size a replica (:func:`fewest_ranks`, :func:`runs_on`, :func:`ranks_needed`) before torch is
imported, so the rule of how many processes a mode runs on is written here once.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Layout", "fewest_ranks", "plan_layout", "ranks_needed", "runs_on"]

# Each mode: its guidance groups, and whether each group is a Ulysses group (2 ranks or more) or
# a single rank. A launch of ``world`` ranks gives each group ``world // groups`` of them.
_MODES: dict[str, tuple[int, bool]] = {"cfg": (2, False), "ulysses": (1, True), "cfg+ulysses": (2, True)}
# Why a mode needs what it needs, and what to launch instead, for plan_layout's error.
_WHY = {"cfg": " (one per guidance branch)", "ulysses": "", "cfg+ulysses": " (2 x N/2)"}
_INSTEAD = {"cfg": "; use --nproc_per_node 2, or parallel='cfg+ulysses' for 4 or more", "ulysses": "",
            "cfg+ulysses": "; use parallel='cfg' on 2"}  # fmt: skip


def _mode(parallel: str) -> tuple[int, bool]:
    try:
        return _MODES[parallel]
    except KeyError:
        raise ValueError(f"parallel must be one of {', '.join(_MODES)}; got {parallel!r}") from None


def fewest_ranks(parallel: str) -> int:
    """The fewest processes ``parallel`` runs on: 2, or 4 for ``cfg+ulysses``. ValueError for a
    mode that is none of ``cfg``, ``ulysses``, ``cfg+ulysses``."""
    groups, ulysses = _mode(parallel)
    return groups * (2 if ulysses else 1)


def runs_on(parallel: str, world: int) -> bool:
    """Whether ``parallel`` runs on ``world`` processes (ValueError for an unknown mode)."""
    groups, ulysses = _mode(parallel)
    fewest = fewest_ranks(parallel)
    return world % groups == 0 and (world >= fewest if ulysses else world == fewest)


def ranks_needed(parallel: str) -> str:
    """The processes ``parallel`` runs on, in words: "2 processes", "2 or more processes", "an even
    number of processes, at least 4" (ValueError for an unknown mode)."""
    groups, ulysses = _mode(parallel)
    fewest = fewest_ranks(parallel)
    if not ulysses:
        return f"{fewest} processes"
    if groups == 1:
        return f"{fewest} or more processes"
    return f"an even number of processes, at least {fewest}"  # two groups of the same size


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
    if not runs_on(parallel, world):
        raise ValueError(
            f"parallel={parallel!r} needs {ranks_needed(parallel)}{_WHY[parallel]}, this launch has {world}"
            f"{_INSTEAD[parallel]}"
        )
    groups = _MODES[parallel][0]
    return Layout(parallel, world, rank, cfg=groups, ulysses=world // groups)
