"""One image on several GPUs: the several-process layer (see :mod:`accel.parallel.session`).

Importing this package registers :class:`ParallelSession` with the accelerator, which builds
one for ``accelerate_pipeline(pipe, parallel=...)``; ``accel`` imports it. The modules, each
above those it builds on:

errors     the errors of a parallel run; every rank raises the same one
layout     which rank computes what: guidance branches times Ulysses ranks
groups     where this rank stands in a parallel run, and the process groups it talks on
process    the process group, liveness, and what ends a rank that is stuck
agreement  what every rank must agree on, compared as digests on the session's gloo groups
ulysses    Ulysses attention with one all-to-all for query, key and value together
setup      what a session does once, collectively, before it installs anything
cfg_split  where each denoiser call goes, and the exchange of guidance branches
session    guidance branches on two ranks, Ulysses context parallelism, or both
"""

from ..hooks.accelerator import register_parallel_session
from .errors import ParallelConfigError, ParallelError
from .layout import Layout, plan_layout
from .session import ParallelSession

register_parallel_session(ParallelSession)

__all__ = ["Layout", "ParallelConfigError", "ParallelError", "ParallelSession", "plan_layout"]
