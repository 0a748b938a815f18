"""The captured entries of one graph runner: least recently used first, within a count and a memory budget.

An :class:`Entry` is one captured call signature: the static input buffers its graphs read, and
a chain per decision path taken so far (:mod:`accel.graphs.branches`). The :class:`EntryStore`
keeps the entries of one runner, evicts the least recently used beyond ``max_entries``, checks a
new capture against the memory budget, and remembers which signatures are refused (blocked) and
which are to be captured again on their next call.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from collections.abc import Hashable, Iterable
from typing import Any, Protocol

import torch

from .branches import GraphTree, path_label
from .errors import GraphMemoryBudgetError
from .signature import Signature

__all__ = ["Entry", "EntryStore", "RunnerStats", "StepState"]

# The runner's messages, whichever of its parts says them.
logger = logging.getLogger("accel.graphs.runner")


@dataclasses.dataclass
class RunnerStats:
    """Counters of one runner. Byte counts are filled by :meth:`GraphRunner.stats`.

    ``captures`` counts captured chains: a new signature's first path, and every later path of a
    call with decisions (``path_captures`` of them). ``path_misses``: replays that took a
    decision value without a graph; ``path_switches``: replays that moved to another path's chain
    at a decision. ``paths_per_entry``: the captured decision paths of each signature.
    ``stored_bytes``: what one replay of every chain copies into the containers its call is given
    (a causal VAE's feature cache; :mod:`accel.graphs.stores`): copies the caller owns and frees,
    allocated outside the pool; the graphs pin none of it. ``state_bytes_kept``: the bytes of
    state (tensors of a per-call object, a K/V cache) that replays did not copy into the static
    inputs because those held them already (:attr:`Entry.state_inputs`).
    """

    captures: int = 0
    replays: int = 0
    misses: int = 0
    eager_calls: int = 0
    capture_failures: int = 0
    evictions: int = 0
    capture_seconds: float = 0.0
    path_captures: int = 0
    path_misses: int = 0
    path_switches: int = 0
    entries: int = 0
    segments_per_entry: list[int] = dataclasses.field(default_factory=list)
    paths_per_entry: list[list[str]] = dataclasses.field(default_factory=list)
    pool_bytes: int = 0
    static_bytes: int = 0
    boundary_bytes: int = 0
    stored_bytes: int = 0
    state_bytes_kept: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StepState(Protocol):
    """State that a call's breaks keep across calls (a step cache's counters and tensors).

    A capture runs the call several times (warm-up runs, the capture pass, a verification); the
    runner takes a snapshot first and restores it after each of those runs, so a capture has the
    effect of exactly one call.
    """

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


@dataclasses.dataclass
class Entry:
    """One captured signature: its static inputs, and a chain per decision path taken so far.

    ``refill``: captured on first use because its graphs had been dropped as stale (see
    :attr:`EntryStore.recapture`). Its other decision paths are captured as calls take them,
    as the warm-up that captured the dropped graphs did: a step cache's cached steps, say,
    which would otherwise run eagerly until the next warm-up.

    ``state_inputs``: the positions of the call's tensors that a per-call object of state holds
    (:attr:`Signature.state_inputs`; a K/V cache the later steps of a pipeline call read, as large
    as the prefix times the layers). The call never writes them (a capture that does is refused),
    so a replay copies one only when its static input does not hold it already: when the caller's
    tensor is another object than the one copied last, or was written since (its version
    counter moved). An inference tensor has no version counter: it is always copied.
    """

    key: Hashable
    signature: Signature
    static_inputs: list[torch.Tensor]
    tree: GraphTree
    blocked_paths: dict[tuple[Any, ...], str] = dataclasses.field(default_factory=dict)
    refill: bool = False
    state_inputs: frozenset[int] = frozenset()
    state_bytes_kept: int = 0
    # What each state input's static buffer holds: (the tensor copied in, weakly; its version then).
    _held: dict[int, tuple[weakref.ref[torch.Tensor], int]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def capture_seconds(self) -> float:
        return sum(c.capture_seconds for c in self.tree.chains.values())

    def _holds(self, i: int, t: torch.Tensor) -> bool:
        """Whether static input ``i`` holds ``t`` already (it was copied from ``t``, unwritten since);
        remembers ``t`` as what it will hold otherwise."""
        if t.is_inference():
            self._held.pop(i, None)
            return False
        held = self._held.get(i)
        if held is not None and held[0]() is t and held[1] == t._version:
            return True
        self._held[i] = (weakref.ref(t), t._version)
        return False

    def static_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.static_inputs)

    def replay(
        self,
        pool: Any,
        graphs: GraphTree,
        leaves: list[torch.Tensor] | None,
        memo: Any = None,
        call: tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor] | None] | None = None,
    ) -> Any:
        """Replay ``graphs`` (this entry's tree, or a chain on trial) on the current stream
        (``leaves`` copied into the static inputs first) and return a copy of its output.
        ``call``: the call's ``(args, kwargs, tensors)``, whose containers get what the chain stores
        (:mod:`accel.graphs.stores`; ``tensors`` None: the static inputs stand for its tensors).

        Ordered after the pool's last replay, so the inputs are not rewritten under a replay
        still reading them; marked done only after the copy, so no later replay (on any stream)
        rewrites the output buffers before they are read. ``memo``: the call's first breaks
        already ran (see :meth:`GraphTree.replay`).
        """
        with pool.lock:
            stream = torch.cuda.current_stream(pool.device)
            pool.order_after_last_replay(stream)
            for i, (s, t) in enumerate(zip(self.static_inputs, leaves or ())):
                if s is t:
                    continue
                if i in self.state_inputs and self._holds(i, t):
                    self.state_bytes_kept += s.numel() * s.element_size()
                    continue
                s.copy_(t)
            try:
                chain = graphs.replay(memo)
                # The output buffers are rewritten by the next replay of any graph in the pool,
                # so nothing returned may alias them.
                out = chain.flat_output.clone()
                if chain.stores is not None and call is not None:
                    args, kwargs, inputs = call
                    chain.stores.apply(args, kwargs, inputs if inputs is not None else self.static_inputs, out)
            finally:  # a break that failed leaves segments in flight: order after them too
                pool.mark_replay_done(stream)
        return out


class EntryStore:
    """The entries of one runner by key, least recently used first, and the keys refused.

    Attributes:
        blocked: key -> why that signature runs eagerly from now on.
        recapture: keys whose graphs were dropped as stale: captured again on their next call.
    """

    def __init__(self, name: str, max_entries: int, memory_budget: int | None, stats: RunnerStats) -> None:
        self.name = name
        self.max_entries = max_entries
        self.memory_budget = memory_budget
        self.stats = stats
        self.entries: collections.OrderedDict[Hashable, Entry] = collections.OrderedDict()
        self.blocked: dict[Hashable, str] = {}
        self.recapture: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Hashable) -> Entry | None:
        return self.entries.get(key)

    def used(self, entry: Entry) -> None:
        """``entry`` just replayed: it is the most recently used."""
        self.entries.move_to_end(entry.key)

    def admit(self, entry: Entry) -> None:
        """Keep a newly captured entry, evicting the least recently used beyond ``max_entries``.

        Called only once the capture succeeded: a failed capture must not cost a good graph.
        """
        for _ in range(self.evictions_to_admit_one()):
            self._evict_lru()
        self.entries[entry.key] = entry
        self.recapture.discard(entry.key)

    def evictions_to_admit_one(self) -> int:
        return max(0, len(self.entries) + 1 - self.max_entries)

    def _evict_lru(self) -> None:
        _key, entry = self.entries.popitem(last=False)
        # A replay of it may still be running on the device.
        torch.cuda.current_stream(entry.static_inputs[0].device).synchronize()
        del entry
        self.stats.evictions += 1
        logger.info("%s: evicted the least recently used graph (max_entries=%d)", self.name, self.max_entries)

    def check_budget(self, entry: Entry, graph: Any, pool: Any, new_entry: bool) -> None:
        """GraphMemoryBudgetError if keeping ``graph`` (a path of ``entry``) exceeds the budget.

        The entries evicted to make room for a new signature (``new_entry``) do not count.
        """
        if self.memory_budget is None:
            return
        pool_bytes = pool.resident_bytes() if pool is not None else 0
        evicted = self.evictions_to_admit_one() if new_entry else 0
        kept = list(self.entries.values())[evicted:]
        # The whole pool, plus static inputs and boundary buffers, which live outside it.
        held = {id(e): e for e in [*kept, entry]}.values()
        total = pool_bytes + sum(e.static_bytes() + e.tree.boundary_bytes() for e in held) + graph.boundary_bytes()
        if total > self.memory_budget:
            raise GraphMemoryBudgetError(
                f"graph memory would be {total / 2**20:.0f} MiB, over the budget of "
                f"{self.memory_budget / 2**20:.0f} MiB"
            )

    def block(self, keys: Iterable[Hashable], reason: str) -> None:
        """Drop these signatures' graphs (if any) and refuse them from now on, for ``reason``."""
        keys = list(keys)
        if any(k in self.entries for k in keys) and torch.cuda.is_available():
            torch.cuda.synchronize()  # a replay of one may still be running
        for key in keys:
            self.entries.pop(key, None)
            self.recapture.discard(key)
            self.blocked[key] = reason

    def clear(self) -> list[Hashable]:
        """Drop every entry and forget refusals and pending recaptures; returns the keys dropped."""
        dropped = list(self.entries)
        if self.entries and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.entries.clear()
        self.blocked.clear()
        self.recapture.clear()
        return dropped

    def fill(self, s: RunnerStats, memory: bool, pool_bytes: int) -> RunnerStats:
        """``s`` with what the entries tell (counts, segments, paths; bytes if ``memory``)."""
        entries = self.entries.values()
        s.entries = len(self.entries)
        s.segments_per_entry = [e.tree.num_segments for e in entries]
        s.paths_per_entry = [[path_label(p) for p in e.tree.paths] for e in entries]
        s.path_switches = sum(e.tree.switches for e in entries)
        if memory:
            s.static_bytes = sum(e.static_bytes() for e in entries)
            s.boundary_bytes = sum(e.tree.boundary_bytes() for e in entries)
            s.stored_bytes = sum(e.tree.stored_bytes() for e in entries)
            s.pool_bytes = pool_bytes
        return s
