"""The errors of the breakable-graph core; :class:`BCGError` is the base of every error the library raises."""

from __future__ import annotations

from typing import Any

__all__ = ["BCGError", "BreakError", "CopyBackError", "NestedBreakError"]


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

    ``output`` is what the break returned, for a caller that finishes the call another way.
    """

    def __init__(self, message: str, output: Any = None) -> None:
        super().__init__(message)
        self.output = output
