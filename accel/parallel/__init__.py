"""One image on several GPUs: the several-process layer (see :mod:`accel.parallel.session`).

Importing this package registers :class:`ParallelSession` with the accelerator, which builds
one for ``accelerate_pipeline(pipe, parallel=...)``; ``accel`` imports it.
"""

from ..hooks.accelerator import register_parallel_session
from .errors import ParallelConfigError, ParallelError
from .layout import Layout, plan_layout
from .session import ParallelSession

register_parallel_session(ParallelSession)

__all__ = ["Layout", "ParallelConfigError", "ParallelError", "ParallelSession", "plan_layout"]
