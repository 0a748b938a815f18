"""Qwen-Image's block modulation computed once per step for both guidance calls.

Every block of Qwen-Image's transformer starts with two modulation products, ``img_mod(temb)``
and ``txt_mod(temb)`` (SiLU, then a Linear of 3072 -> 18432): one row per sample, each reading a
113 MB weight, 120 of them per call. ``temb`` is a function of the timestep alone, and with true
CFG the pipeline calls the transformer twice per step at the same timestep (``"cond"``, then
``"uncond"``, one sample each at 1024x1024): every step read those 13.5 GB twice (about 5.4 ms
of a 209 ms float8 step on an H100, at the memory's rate).

:class:`ModulationOnce` lets the second call read what the first one computed:

* **Host decision, per call** (:meth:`ModulationOnce.role`, from the recipe's
  :meth:`~accel.Recipe.route_call`, before the runner): a call whose timestep values, batch, dtype
  and device are those of the call just before it, which computed, *reuses*; any other computes.
  The timesteps are read on the host (one small copy per call); a reuse follows its computing call
  directly (never a second reuse, never across pipeline calls, so no weight change between calls
  can be read stale), and a computing call that raised leaves nothing to reuse. The role travels as a constant keyword of the call (:data:`ROLE_KWARG`), so
  each role has its own graphs, and the recipe's forward takes it out again.
* **Fixed buffers**: each block's two products are written to a buffer of its own (an attribute
  of the ``img_mod`` / ``txt_mod`` module, one row per sample, made before any capture on the
  host), which the computing call's graph writes and the reusing call's graph reads by address.
* **The same bits**: the reusing call returns exactly what the computing call's product gave for
  the same ``temb`` (same kernel, same input), so every call's output is bit for bit today's,
  with or without graphs, compiled or not. Under ``cfg_batch`` the two branches are one call of
  two samples already, whose product reads each weight once: it computes, as before.

Not applied where ``temb`` is not a function of the timestep alone (``zero_cond_t``, additional
timestep conditions, guidance embeddings): those calls compute as diffusers does.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from accel import patch

__all__ = ["COMPUTE", "REUSE", "ROLE_KWARG", "ModulationOnce", "modulation_once"]

logger = logging.getLogger(__name__)

ROLE_KWARG = "_bcg_modulation"
COMPUTE, REUSE = "compute", "reuse"
_SLOT = "_bcg_modulation_rows"
WHY = "qwen-image: block modulation once per step for both guidance calls"

# The role of the call running now, read by every block's modulation (a global, not an attribute
# of the modules: the library watches their dictionaries). One call at a time in the process: the
# recipe's forward holds the lock while a role is set.
_ROLE: str | None = None
_LOCK = threading.RLock()


def _modulation_forward(self: torch.nn.Sequential, temb: torch.Tensor) -> torch.Tensor:
    """A block's ``img_mod`` / ``txt_mod``: its product, written to its rows (computing call),
    or the rows the computing call of this timestep wrote (reusing call)."""
    role = _ROLE
    rows = getattr(self, _SLOT)
    if role is None or temb.shape[0] > rows.shape[0] or temb.device != rows.device or temb.dtype != rows.dtype:
        return torch.nn.Sequential.forward(self, temb)
    if role == REUSE:
        return rows[: temb.shape[0]]
    out = torch.nn.Sequential.forward(self, temb)
    rows[: temb.shape[0]].copy_(out)
    return out


class ModulationOnce:
    """Qwen-Image's block modulation once per step (see the module docstring) on one transformer."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.mods: list[torch.nn.Sequential] = [
            m for block in module.transformer_blocks for m in (block.img_mod, block.txt_mod)
        ]
        self.width = self.mods[0][1].out_features
        self.rows = 0
        self._last: tuple[Any, ...] | None = None  # what the last call computed for, if it computed
        self.reused = 0

    @staticmethod
    def applies(module: torch.nn.Module) -> bool:
        """Whether ``module``'s modulation is a function of the timestep alone, in diffusers' modules."""
        blocks = getattr(module, "transformer_blocks", None)
        config = getattr(module, "config", None)
        if not blocks or config is None or getattr(config, "zero_cond_t", False) or config.get("guidance_embeds"):
            return False
        if getattr(config, "use_additional_t_cond", False):
            return False
        return all(
            type(getattr(b, name, None)) is torch.nn.Sequential
            and len(getattr(b, name)) == 2
            and type(getattr(b, name)[0]) is torch.nn.SiLU
            and "forward" not in vars(getattr(b, name))
            for b in blocks
            for name in ("img_mod", "txt_mod")
        )

    def install(self) -> Callable[[], None]:
        """Give every modulation its forward and rows (none yet: made at the first call) until the
        returned undo is called."""
        held = []
        for m in self.mods:
            held.append(patch(m, "forward", types.MethodType(_modulation_forward, m), why=WHY, where="dict"))
            held.append(patch(m, _SLOT, torch.empty(0, self.width), why=WHY, where="dict"))
        self._held = held
        return lambda: [p.undo() for p in reversed(held)] and None

    def _ensure_rows(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Rows for ``batch`` samples in every modulation, made on the host before a capture can
        need them (doubling; replaced rows stay alive with the graphs that read them)."""
        current = self.mods[0].__dict__[_SLOT]
        if current.shape[0] >= batch and current.dtype == dtype and current.device == device:
            return
        rows = max(batch, 2 * current.shape[0] if current.dtype == dtype and current.device == device else batch)
        for m in self.mods:
            self._held.append(
                patch(m, _SLOT, torch.zeros(rows, self.width, dtype=dtype, device=device), why=WHY, where="dict")
            )
        self.rows = rows
        self._last = None

    def role(self, kwargs: Mapping[str, Any]) -> str | None:
        """This call's role (:data:`COMPUTE` or :data:`REUSE`), or None where it does not apply
        (no timestep tensor, a guidance or extra timestep input)."""
        timestep, hidden = kwargs.get("timestep"), kwargs.get("hidden_states")
        if not isinstance(timestep, torch.Tensor) or not isinstance(hidden, torch.Tensor) or timestep.dim() != 1:
            return None
        if kwargs.get("guidance") is not None or kwargs.get("additional_t_cond") is not None:
            return None
        batch = timestep.shape[0]
        self._ensure_rows(batch, hidden.dtype, hidden.device)
        # temb = time_text_embed(timestep, hidden_states): the timestep's values and the dtype.
        key = (batch, hidden.dtype, hidden.device, timestep.dtype, tuple(timestep.tolist()))
        if self._last == key:
            self._last = None  # one reuse per computing call
            self.reused += 1
            return REUSE
        self._last = key
        return COMPUTE

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The forward that takes :data:`ROLE_KWARG` out of a call and runs ``fn`` in that role."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            global _ROLE
            role = kwargs.pop(ROLE_KWARG, None)
            if role is None:
                return fn(*args, **kwargs)
            with _LOCK:
                outer, _ROLE = _ROLE, role
                try:
                    return fn(*args, **kwargs)
                except BaseException:
                    # A call that failed may have written some rows only: the next call computes.
                    self._last = None
                    raise
                finally:
                    _ROLE = outer

        return forward


def modulation_once(module: torch.nn.Module) -> ModulationOnce | None:
    """A :class:`ModulationOnce` for ``module`` where its modulation is the timestep's alone, else None."""
    return ModulationOnce(module) if ModulationOnce.applies(module) else None
