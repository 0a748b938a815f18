"""The two ways generation fails, each told in one line, and any exception told in one line.

A front end turns them into what its user sees: ``bcg-generate`` into one line on stderr and the
error's :attr:`~GenerationError.status` as its exit status, ``bcg-serve`` into an exit status at
start and a 400 or 500 answer per request.
"""

from __future__ import annotations

__all__ = ["GenerationError", "InputError", "RunError", "one_line"]


class GenerationError(Exception):
    """What a front end reports in one line; ``status`` is the exit status it ends a command with."""

    status = 1


class InputError(GenerationError):
    """Bad input (a flag, a size, a model that cannot do what is asked): exit status 2."""

    status = 2


class RunError(GenerationError):
    """A failure while loading or generating: exit status 1."""

    status = 1


def one_line(e: BaseException) -> str:
    """``e``'s message, its first line only (its type's name where it has none)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
