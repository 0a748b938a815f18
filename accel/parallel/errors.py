"""The errors of a parallel run; every rank raises the same one."""

from __future__ import annotations

from ..graphs.errors import BCGError

__all__ = ["PREFIX", "ParallelConfigError", "ParallelError"]

PREFIX = "bcg-diffusers parallel"


class ParallelError(BCGError):
    """The ranks of a parallel run disagree or lost contact; raised on every rank, one line."""


class ParallelConfigError(ParallelError, ValueError):
    """``accelerate_pipeline(parallel=...)`` cannot run with these options on these ranks."""
