"""A captured call as a small tree of chains: one breakable graph per decision path.

A decision (``eager_on_graph(decision=True)``, see :mod:`accel.graphs.bcg`) picks what the code does
next from a host value: a cache's "compute the remaining blocks, or reuse last step's". One
capture follows one value of each decision it meets; a :class:`GraphTree` keeps one chain for
every path captured so far, all in the same memory pool and reading the same static inputs.

Contract:

* Replay starts on the chain of the path this tree took at the same position of the last
  sequence of calls (:meth:`GraphTree.new_sequence`: a pipeline call, whose steps tend to repeat
  the last call's pattern), else on the chain taken last. At each decision it runs the decision;
  while the value agrees with the chain's, the walk goes on. When it does not, the walk moves to a
  chain whose path starts with the values taken so far: that chain's segments up to the decision
  are replayed (its own copy of the prefix, at its own addresses), with the boundary buffers of
  its breaks filled from the breaks that already ran instead of running them again, and the walk
  continues there. A replay never runs a segment captured for another value.
* When no chain starts with the values taken, :class:`PathMiss` is raised, carrying the path and a
  :class:`~accel.graphs.bcg.Memo` of what every break of this call returned so far: the caller finishes
  the call by running it again under that memo (eagerly, or capturing the new path) so that no
  break's host effect happens twice.
* Segments before a decision run once per chain switch, so they must be idempotent: they may
  write state another step reads only as a function of the call's inputs. (A cache that reads
  and rewrites its state does so after its decision, or inside a break.)
* Chains of one tree must agree on their shared prefixes (the same breaks up to each shared
  decision); :meth:`GraphTree.add` refuses one that does not.

This module knows nothing of diffusers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from . import bcg, tree

if TYPE_CHECKING:
    from .stores import Stores

__all__ = ["Chain", "GraphTree", "PathMiss"]


class PathMiss(Exception):
    """A replay took a decision value no chain was captured for.

    Attributes:
        path: the decision values taken, the last one being the one without a chain.
        memo: what every break of this call returned so far, for running the call again.
    """

    def __init__(self, path: tuple[Any, ...], memo: bcg.Memo) -> None:
        super().__init__(f"no graph for decision path {path!r}")
        self.path = path
        self.memo = memo


@dataclasses.dataclass
class Chain:
    """One captured path: its breakable graph, the output buffers its last segment writes, and
    what it stores into the containers the call is given (:mod:`accel.graphs.stores`; None: nothing)."""

    graph: bcg.BreakableCUDAGraph
    output: Any
    keepalive: list[Any]
    capture_seconds: float
    replays: int = 0
    stores: Stores | None = None
    flat_output: tree.Flat = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.flat_output = tree.Flat(self.output)

    @property
    def path(self) -> tuple[Any, ...]:
        return self.graph.path


def _memo(chain: Chain, upto: int, extra: Sequence[tuple[str, Any]] = ()) -> bcg.Memo:
    """What breaks ``0..upto-1`` of ``chain`` returned in the replay that just ran them."""
    entries = [(b.name, b.memo_value()) for b in chain.graph.breaks[:upto]]
    return bcg.Memo(entries + list(extra))


def _decision_positions(chain: Chain) -> list[int]:
    return [i for i, b in enumerate(chain.graph.breaks) if b.kind.decision or b.kind.keyed]


class GraphTree:
    """The chains of one captured call signature, by decision path.

    A call without decisions has one chain, with the empty path.
    """

    def __init__(self) -> None:
        self.chains: dict[tuple[Any, ...], Chain] = {}
        self._last: Chain | None = None
        self.switches = 0
        # The chains taken, call by call, in the current and the previous sequence.
        self._taken: list[Chain] = []
        self._before: list[Chain] = []

    def new_sequence(self) -> None:
        """A new sequence of calls begins (a pipeline call): its replays start where the
        previous sequence's did, call by call."""
        if self._taken:
            self._before, self._taken = self._taken, []

    def __len__(self) -> int:
        return len(self.chains)

    @property
    def paths(self) -> list[tuple[Any, ...]]:
        return list(self.chains)

    @property
    def num_segments(self) -> int:
        return sum(c.graph.num_segments for c in self.chains.values())

    def boundary_bytes(self) -> int:
        return sum(c.graph.boundary_bytes() for c in self.chains.values())

    def stored_bytes(self) -> int:
        """Bytes one replay of every chain copies into the containers a call is given."""
        return sum(c.stores.nbytes() for c in self.chains.values() if c.stores is not None)

    @property
    def stores(self) -> bool:
        """Whether a chain stores into the containers the call is given."""
        return any(c.stores is not None for c in self.chains.values())

    def add(self, chain: Chain) -> None:
        """Keep ``chain``; ValueError if it does not branch off every other chain at a decision
        reached through the same breaks (the call is not deterministic, or a path is stale)."""
        path = chain.path
        if path in self.chains:
            raise ValueError(f"a chain for decision path {path!r} exists already")
        mine = _decision_positions(chain)
        for other in self.chains.values():
            theirs = _decision_positions(other)
            shared = 0
            while shared < min(len(path), len(other.path)) and path[shared] == other.path[shared]:
                shared += 1
            if shared == min(len(path), len(other.path)):
                raise ValueError(f"decision paths {path!r} and {other.path!r} part without a decision between them")
            a = chain.graph.break_names[: mine[shared] + 1]
            b = other.graph.break_names[: theirs[shared] + 1]
            if a != b:
                raise ValueError(
                    f"decision path {path!r} reached decision {shared} through breaks {a}, {other.path!r} through {b}"
                )
        self.chains[path] = chain
        self._last = chain

    def find(self, taken: tuple[Any, ...]) -> Chain | None:
        """A chain whose path starts with ``taken`` (the last one used if it does)."""
        if self._last is not None and self._last.path[: len(taken)] == taken:
            return self._last
        for chain in self.chains.values():
            if chain.path[: len(taken)] == taken:
                return chain
        return None

    def replay(self, memo: bcg.Memo | None = None) -> Chain:
        """Replay the call on the current stream, following its decisions; returns the chain
        whose output buffers hold the result. ``memo``: the call's first breaks already ran
        (a path capture's own call); they take their values from it instead of running.

        Raises :class:`PathMiss` (see the contract) or :class:`~accel.graphs.bcg.CopyBackError` (a
        break's output no longer fits its buffer; ``exc.memo`` says what ran before it).
        """
        n = len(self._taken)
        if n < len(self._before) and self._before[n].path in self.chains:
            chain = self._before[n]
        else:
            chain = self._last if self._last is not None else next(iter(self.chains.values()))
        memo = memo.fresh() if memo is not None else None
        taken: list[Any] = []
        i = 0
        breaks = chain.graph.breaks
        while i < len(breaks):
            chain.graph.segments[i].replay()
            brk = breaks[i]
            try:
                if brk.kind.keyed:
                    # Its output's structure picks the chain; its buffer is filled once it has.
                    out = memo.take(brk.name) if memo is not None and memo.pending else brk.run()
                    value = bcg.structure_key(out)
                    if value == brk.value:
                        brk.set_from(out)
                elif memo is not None and memo.pending:
                    value = out = memo.take(brk.name)
                    brk.set_from(value)
                    if not brk.kind.decision:
                        value = None
                else:
                    value = out = brk()
            except bcg.CopyBackError as exc:
                exc.memo = _memo(chain, i, [(brk.name, exc.output)])
                raise
            if brk.kind.decision or brk.kind.keyed:
                taken.append(value)
                if value != brk.value:
                    other = self.find(tuple(taken))
                    if other is None:
                        raise PathMiss(tuple(taken), _memo(chain, i, [(brk.name, out)]))
                    self._catch_up(chain, other, i)
                    chain, breaks = other, other.graph.breaks
                    if brk.kind.keyed:
                        breaks[i].set_from(out)
                    self.switches += 1
            i += 1
        chain.graph.segments[-1].replay()
        chain.replays += 1
        self._last = chain
        self._taken.append(chain)
        return chain

    @staticmethod
    def _catch_up(done: Chain, to: Chain, upto: int) -> None:
        """Bring ``to`` to decision ``upto``: replay its segments before it, feeding its breaks
        what ``done``'s breaks just returned."""
        for j in range(upto + 1):
            to.graph.segments[j].replay()
            if j < upto:
                to.graph.breaks[j].set_from(done.graph.breaks[j].memo_value())


def path_label(path: tuple[Hashable, ...]) -> str:
    """A short label for reports: runs of one value are counted (``True x60``); ``()`` is the
    only path of a call without decisions."""
    if not path:
        return "(no decisions)"
    runs: list[list[Any]] = []
    for value in path:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "-".join(str(v) if n == 1 else f"{v} x{n}" for v, n in runs)
