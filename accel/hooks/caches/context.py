"""Which diffusers ``cache_context`` a denoiser call runs under (a guidance branch's name).

Pipelines with step caches wrap each guidance branch's denoiser call in
``with transformer.cache_context("cond"): ...``; diffusers tells every *stateful* hook of the
module the current context. A :class:`ContextProbe` is what such a hook holds to hear it: the
step caches' rules (their state is per branch), the joined guidance branches and the
several-GPU router (which call is which branch) read its :attr:`~ContextProbe.name`.
"""

from __future__ import annotations

from diffusers.hooks.hooks import BaseState, StateManager

__all__ = ["ContextProbe"]


class ContextProbe(StateManager):
    """Hears the ``CacheContext`` that diffusers' ``cache_context`` sets on stateful hooks."""

    def __init__(self) -> None:
        super().__init__(BaseState)

    @property
    def name(self) -> str | None:
        context = self._context
        return context if isinstance(context, str) or context is None else getattr(context, "name", None)
