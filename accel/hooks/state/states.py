"""Graphs kept per state: the numbers that key a module's graphs by the Python state they were captured in.

A change of Python state alone (``set_adapters`` between two loaded adapters or scales,
``disable_lora``/``enable_lora``, a processor swapped and swapped back) does not drop a module's
graphs. Its runner keys every graph by ``(weights epoch, state number, the step caches' key)``
(:meth:`accel.hooks.state.follow.Follower.key`), so each state's graphs stay, within ``max_entries``
(least recently used first), and switching back to a state replays the graphs captured in it.

A state number stands for one :attr:`accel.hooks.state.watch.Look.record`: states with equal records
share it, and a number is never given to another state, so no graph can match a state it was not
captured in. The weights epoch grows whenever a tensor is added, removed, replaced, moved or
written in place: every graph of the module is dropped then (they read freed or other memory),
and the records are forgotten with them.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

__all__ = ["StateKeys", "pending_keys"]


class StateKeys:
    """Numbers for the states seen since the weights last changed, at most ``limit`` of them
    (the least recently used record is forgotten first; its graphs can then never match again,
    and leave the runner as it evicts them)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._records: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._next = 0

    def number(self, record: Any) -> tuple[int, bool]:
        """The number of the state ``record`` describes, and whether it was seen before."""
        for number, seen in reversed(self._records.items()):
            if seen == record:
                self._records.move_to_end(number)
                return number, True
        number = self._next
        self._next += 1
        self._records[number] = record
        while len(self._records) > self.limit:
            self._records.popitem(last=False)
        return number, False

    def relabel(self, number: int, record: Any) -> None:
        """State ``number`` is now described by ``record`` (its graphs were captured in it)."""
        self._records[number] = record
        self._records.move_to_end(number)
        for other in [n for n, seen in self._records.items() if n != number and seen == record]:
            del self._records[other]

    def clear(self) -> None:
        """Forget every record (the weights changed: no graph of theirs is left)."""
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)


def _prefix_of(key: Hashable) -> tuple[Any, ...] | None:
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple) and len(key[1]) >= 2:
        return key[1][:2]
    return None


def pending_keys(keys: list[Hashable], old: tuple[int, int], new: tuple[int, int]) -> set[Hashable]:
    """The runner keys of ``keys`` captured under ``old`` (weights epoch, state number), as they
    read under ``new``: what to capture again on the next call, as the calls before would have."""
    out = set()
    for key in keys:
        if _prefix_of(key) == old:
            signature, extra = key  # type: ignore[misc]
            out.add((signature, (*new, *extra[2:])))
    return out


def kept_under(keys: list[Hashable], prefix: tuple[int, int]) -> int:
    """How many of ``keys`` were captured under ``prefix``."""
    return sum(1 for key in keys if _prefix_of(key) == prefix)
