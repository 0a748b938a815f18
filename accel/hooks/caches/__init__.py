"""Step caches under graphs: diffusers' FirstBlockCache, TaylorSeer and MagCache, and cache-dit's
DBCache, each applied the way its library documents, keep every decision they make at graph speed.

:class:`~accel.hooks.caches.binding.CacheBinding` finds them on a denoiser (and refuses, by name, any
hook it has no rule for); :mod:`accel.hooks.caches.rules` says what a rule does;
:mod:`accel.hooks.caches.context` gives a call the ``cache_context`` diffusers' caches keep their
state in.

The modules: ``slots`` (fixed-address buffers for what a cache keeps between steps), ``rules``,
``context``, ``diffusers_caches`` (FirstBlockCache, TaylorSeer, MagCache), ``cache_dit``
(DBCache) and ``binding`` (the caches on one denoiser: found, made safe, or refused by name).

May import: :mod:`accel.graphs` (and, for what a rule wraps, diffusers and cache-dit); nothing of
this layer outside the package.
"""

from .binding import CacheBinding, find_caches
from .rules import CacheRule

__all__ = ["CacheBinding", "CacheRule", "find_caches"]
