"""The errors of the breakable-graph core; :class:`BCGError` is the base of every error the library raises."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BCGError",
    "BreakError",
    "CopyBackError",
    "DeviceMemoryShortError",
    "GraphMemoryBudgetError",
    "NestedBreakError",
]


class BCGError(RuntimeError):
    """Base class of the errors bcg-diffusers raises (``except accel.BCGError`` catches them all).

    A RuntimeError, as each of them was before it had a common base.
    """


class BreakError(BCGError):
    """Base class of the errors raised by the breakable-graph core."""


class NestedBreakError(BreakError):
    """A marked function was called while another marked function was running as a break."""


class CopyBackError(BreakError):
    """A break's replay output does not match the boundary buffer recorded at capture.

    ``output`` is what the break returned, for a caller that finishes the call another way;
    ``memo``, set where a replay raised it, what every break of the call returned until then.
    """

    def __init__(self, message: str, output: Any = None) -> None:
        super().__init__(message)
        self.output = output
        self.memo: Any = None


class GraphMemoryBudgetError(BCGError):
    """A capture was refused because graph memory would exceed the runner's ``memory_budget``.

    Not a :class:`MemoryError` (nothing ran out of memory: a limit the caller set was reached)
    and not a :class:`BreakError` (those come from the breakable-graph core; the budget is the
    runner's policy). The runner catches it like any capture failure: the signature is blocked
    and runs eagerly, and :attr:`GraphRunner.blocked` keeps the reason.
    """


class DeviceMemoryShortError(BCGError):
    """A capture was not begun: the device had too little memory free for one, even after the
    allocator's cache was emptied (what live tensors pin cannot be given back).

    A capture that runs out of memory midway can leave the device unusable; refusing first keeps
    the call eager and the device well. Caught like any capture failure: the signature is
    blocked and runs eagerly.
    """
