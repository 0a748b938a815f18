"""The CLI's two errors, and any exception told in one line."""

from __future__ import annotations


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""

    status = 2


class RunError(CLIError):
    """A failure while loading or generating: one line on stderr, exit status 1."""

    status = 1


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
