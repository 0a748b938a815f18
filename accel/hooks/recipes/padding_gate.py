"""Whether a recipe may pad a call: every attention processor on the module's path must take the mask, and the attention backend it runs must apply it.

A recipe that pads text (so that prompts of different lengths share a graph) hands the model a
mask of the padded tokens, and relies on attention to ignore them. diffusers' ``Attention`` gives
a processor only the keywords its ``__call__`` names, as ``inspect.signature`` reads it, and drops
the rest with a warning: a processor written as ``__call__(self, attn, *args, **kwargs)`` (how
IP-Adapter and attention-map tools wrap the stock one) never sees the mask, and attends the padded
tokens. The stock pipeline pads nothing, so it loses nothing; a padded call would be silently
wrong. So padding runs only while every processor in the module names the recipe's mask keyword
(:attr:`~accel.hooks.recipes.recipe.Recipe.pad_mask_kwarg`), looked at when the module is first followed
and again whenever the guard numbers a new state (a processor swapped, edited or wrapped).

The test is what diffusers itself tests, so it is exact for ``Attention``; for attention modules
that pass every keyword on (``AttentionModuleMixin``), a processor taking ``**kwargs`` is refused
too: that costs graph sharing, never an image.

A processor that takes the mask hands it to diffusers' attention dispatch, whose backend may
refuse it (``_native_flash``, flash-attn, sage: ``ValueError: `attn_mask` is not supported``)
where the stock pipeline, which pads nothing, passes none. So padding also waits for every
backend in use (a processor's own, else diffusers' process-wide active one) to take a mask, as
:mod:`accel.hooks.recipes.mask_backends` asks diffusers' registry. Both are watched state: a
backend set on the processors or process-wide numbers a new state, and the gate looks again.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable
from typing import Any

import torch

from .mask_backends import attention_processors, backend_refusal, backends_in_use
from .recipe import Recipe

__all__ = ["PaddingGate", "backends_refusing", "processors_dropping", "refusal"]

logger = logging.getLogger(__name__)


def _names(processor: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(processor.__call__).parameters
    except (TypeError, ValueError):  # no signature to read: nothing says it takes the keyword
        return False


def processors_dropping(module: torch.nn.Module, keyword: str) -> list[str]:
    """``path (ProcessorClass)`` of every attention processor in ``module`` whose ``__call__``
    does not name ``keyword`` (diffusers would drop it), in module order."""
    dropping: list[str] = []
    said: dict[type, bool] = {}
    for path, processor in attention_processors(module):
        # One signature per class, unless an instance carries its own __call__.
        own = "__call__" in getattr(processor, "__dict__", {})
        kind = type(processor)
        ok = _names(processor, keyword) if own or kind not in said else said[kind]
        if not own:
            said[kind] = ok
        if not ok:
            dropping.append(f"{path} ({kind.__name__})")
    return dropping


def backends_refusing(module: torch.nn.Module) -> list[tuple[str, list[str], str]]:
    """``(backend, module paths, why)`` for every attention backend in use in ``module`` that
    would not apply a mask, in module order."""
    return [(b, paths, why) for b, paths in backends_in_use(module).items() if (why := backend_refusal(b)) is not None]


def _who(paths: list[str]) -> tuple[str, str]:
    more = len(paths) - 1
    return paths[0] + (f" and {more} more" if more else ""), "takes" if not more else "take"


def refusal(module: torch.nn.Module, keyword: str) -> str | None:
    """Why padding that relies on ``keyword`` must not run in ``module`` now, in one phrase; None
    where every processor takes it and every attention backend in use applies it."""
    dropping = processors_dropping(module, keyword)
    if dropping:
        who, verb = _who(dropping)
        return f"the attention processor of {who} {verb} no {keyword}, so padded tokens would be attended"
    refusing = backends_refusing(module)
    if refusing:
        backend, paths, why = refusing[0]
        who, _ = _who(paths)
        return f"the attention backend {backend} (of {who}) takes no mask: {why}"
    return None


class PaddingGate:
    """Keeps ``recipe.padding_refused`` true to ``module``'s processors and attention backends,
    looking again only when ``looked`` moves (the guard's numbered state and weights epoch: a
    processor swapped, edited or wrapped, a backend set on it or process-wide, always moves it),
    so the per-call cost is one comparison."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._looked: Hashable | None = None

    def look(self, recipe: Recipe, module: torch.nn.Module, looked: Hashable) -> None:
        keyword = recipe.pad_mask_kwarg
        if keyword is None or looked == self._looked:
            return
        self._looked = looked
        refused = refusal(module, keyword)
        if refused != recipe.padding_refused:
            if refused is not None:
                logger.warning("%s: text is not padded: %s; one graph per text length", self.name, refused)
            else:
                logger.info(
                    "%s: every attention processor and backend takes %s again; text is padded again", self.name, keyword
                )
        recipe.padding_refused = refused
