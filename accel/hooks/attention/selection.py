"""``attention=``: which attention backend the denoisers get, or why they keep theirs.

:func:`plan_attention` decides at install, before anything is put in: ``attention="fa3"`` sets
FlashAttention-3 (:data:`~accel.hooks.attention.backends.FA3`) on every attention processor of
the denoisers that goes through diffusers' dispatch, where it can run (the wheel installed, a
Hopper GPU). Where it cannot, the denoisers keep the backend they have and one warning says why:
the image is the same as without the option, never a failed install. :class:`AttentionChoice`
sets it (:meth:`~AttentionChoice.enter`) and takes it out again (the undo it returns).

A backend set by the user through diffusers (``transformer.set_attention_backend("bcg_fa3")``,
after :func:`~accel.hooks.attention.backends.register`) is theirs: it is used and reported, not
undone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import torch

from ..components import module_device
from ..options import AcceleratorOptions
from .backends import FA3, describe_backend, dispatching_processors, register, set_backend
from .fa3 import why_not_fa3

__all__ = ["AttentionChoice", "plan_attention"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AttentionChoice:
    """What ``attention=`` does to one pipeline's denoisers.

    Attributes:
        requested: the option's value (``"fa3"``).
        backend: the backend name set (None where it cannot run).
        why_not: why it is not set, in one phrase (None where it is).
        processors: per denoiser, how many processors it sets; ``around``: how many call torch's
            attention themselves (no backend reaches them).
    """

    requested: str
    backend: str | None
    why_not: str | None
    processors: dict[str, int] = dataclasses.field(default_factory=dict)
    around: dict[str, int] = dataclasses.field(default_factory=dict)

    def enter(self, denoisers: Mapping[str, torch.nn.Module]) -> Callable[[], None]:
        """Set the backend on the denoisers' processors (or say once why not); the undo."""
        if self.backend is None:
            logger.warning("attention=%r not used: %s; attention runs as before", self.requested, self.why_not)
            return lambda: None
        undo = [set_backend(module, self.backend) for module in denoisers.values()]
        logger.info(
            "attention=%r: %s on %s",
            self.requested,
            self.backend,
            ", ".join(f"{n} ({self.processors[n]} processors)" for n in denoisers),
        )
        return lambda: [u() for u in reversed(undo)] and None

    def describe(self) -> str:
        """The report's line."""
        if self.backend is None:
            return f"  attention {self.requested}: not used ({self.why_not}); attention runs as before"
        sets = ", ".join(f"{n} {c} processors" for n, c in self.processors.items())
        around = sum(self.around.values())
        tail = f"; {around} processors call torch's attention themselves, unchanged" if around else ""
        return f"  attention {self.requested}: {describe_backend(self.backend)}; {sets}{tail}"


def plan_attention(options: AcceleratorOptions, denoisers: Mapping[str, torch.nn.Module]) -> AttentionChoice | None:
    """What ``options.attention`` will do to ``denoisers`` (by component name); None where the
    option is unset. Registers the library's backends where they can run."""
    if options.attention is None:
        return None
    assert options.attention == "fa3", options.attention
    devices = {module_device(m) for m in denoisers.values()}
    why = next((w for d in sorted(devices, key=str) if (w := why_not_fa3(d)) is not None), None)
    if why is None:
        try:
            register()
        except Exception as e:  # a diffusers whose dispatch is not the one this was written for
            why = f"diffusers' attention dispatch cannot take it ({type(e).__name__}: {e})"
    choice = AttentionChoice(options.attention, FA3 if why is None else None, why)
    for name, module in denoisers.items():
        through, around = dispatching_processors(module)
        choice.processors[name] = len({id(p) for _, p in through})
        choice.around[name] = len(around)
    if choice.backend is not None and not any(choice.processors.values()):
        choice.backend, choice.why_not = (
            None,
            "no attention processor of the denoisers goes through diffusers' dispatch",
        )
    return choice
