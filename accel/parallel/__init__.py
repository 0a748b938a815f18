"""One image on several GPUs: the several-process layer (see :mod:`accel.parallel.session`).

Importing this package registers :class:`ParallelSession` with the accelerator, which builds
one for ``accelerate_pipeline(pipe, parallel=...)``; ``accel`` imports it.
"""

from ..hooks.accelerator import register_parallel_session
from .session import ParallelConfigError, ParallelError, ParallelSession, plan_layout

register_parallel_session(ParallelSession)

__all__ = ["ParallelConfigError", "ParallelError", "ParallelSession", "plan_layout"]
