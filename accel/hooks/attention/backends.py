"""The library's attention backends in diffusers' own dispatch, and setting them on a model.

diffusers' attention processors call ``dispatch_attention_fn(..., backend=processor._attention_backend)``,
which looks the backend up in its registry (``_AttentionBackendRegistry``: the function, its
argument names, its checks) by a member of ``AttentionBackendName``. So a backend registered
there runs under the stock processors, is what ``model.set_attention_backend(name)`` sets, and is
what the library's guard, padding gate and reports already read. diffusers' own ``_flash_3``
cannot take the ``fa3-fwd`` wheel as it is: it imports ``flash_attn_interface`` at its own import,
and only where the ``flash_attn_3`` distribution is installed, refuses every mask and passes no
descales. So the wheel's forward comes in under names of the library's own (:data:`FA3`,
:data:`FA3_FP8`), each a member added to diffusers' enum and an entry in its registry.

:func:`register` puts them in for the rest of the process (reversible patches, listed by
``pipe.accel.report()``), once, where FlashAttention-3 can run; after it, diffusers' own
``transformer.set_attention_backend("bcg_fa3")`` works as for any backend. :func:`set_backend`
sets one on a model's processors until its undo is called (what ``attention="fa3"`` does).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...graphs.patches import Patch, patch
from .fa3 import fa3_attention, fa3_fp8_attention

__all__ = [
    "BACKENDS",
    "FA3",
    "FA3_FP8",
    "describe_backend",
    "dispatching_processors",
    "member",
    "register",
    "registered",
    "set_backend",
]

logger = logging.getLogger(__name__)

FA3 = "bcg_fa3"
FA3_FP8 = "bcg_fa3_fp8"
# name -> (the backend function, what the report says of it)
BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    FA3: (fa3_attention, "FlashAttention-3 (fa3-fwd), bf16: lossless, not bit for bit cuDNN's attention"),
    FA3_FP8: (fa3_fp8_attention, "FlashAttention-3 (fa3-fwd) on float8 queries, keys and values, per-head scales"),
}

_lock = threading.Lock()
# Process-wide, as diffusers' own registrations are; kept for the process's life.
_held: list[Patch] = []


def _dispatch() -> Any:
    import diffusers.models.attention_dispatch as dispatch

    return dispatch


def registered() -> bool:
    """Whether :func:`register` put the library's backends into diffusers' dispatch."""
    return bool(_held) and all(p.in_place for p in _held)


def member(name: str) -> Any:
    """The ``AttentionBackendName`` member of one of :data:`BACKENDS` (registered first)."""
    register()
    return _dispatch().AttentionBackendName(name)


def _new_member(enum: Any, name: str) -> Any:
    """A member of diffusers' ``AttentionBackendName`` (a ``str`` enum) for ``name``, made as the
    enum makes its own: the string, with the enum's name and value on it."""
    value = str.__new__(enum, name)
    value._name_ = name.upper()
    value._value_ = name
    value.__objclass__ = enum
    return value


def register() -> None:
    """Put :data:`BACKENDS` into diffusers' attention dispatch for the rest of the process
    (idempotent). Each is a member of ``AttentionBackendName`` (so ``AttentionBackendName(name)``,
    ``set_attention_backend(name)`` and ``attention_backend(name)`` know it) and a registry entry,
    with no checks (the functions check what they take themselves)."""
    with _lock:
        if registered():
            return
        dispatch = _dispatch()
        enum, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
        why = "the library's FlashAttention-3 backends in diffusers' attention dispatch"
        held = []
        for name, (fn, _) in BACKENDS.items():
            value = enum._value2member_map_.get(name) or _new_member(enum, name)
            held += [
                patch(enum._member_map_, value._name_, value, why=why, where="item"),
                patch(enum._value2member_map_, name, value, why=why, where="item"),
                patch(registry._backends, value, fn, why=why, where="item"),
                patch(registry._constraints, value, [], why=why, where="item"),
                patch(
                    registry._supported_arg_names, value, set(inspect.signature(fn).parameters), why=why, where="item"
                ),
            ]
        _held[:] = held
        logger.debug("attention backends %s registered in diffusers' dispatch", ", ".join(BACKENDS))


def unregister() -> None:
    """Take the library's backends out of diffusers' dispatch again (tests; processors still
    set to one of them would fail at their next call)."""
    with _lock:
        while _held:
            _held.pop().undo()


def _attention_classes() -> tuple[type, ...]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return (Attention, AttentionModuleMixin)


def dispatching_processors(model: torch.nn.Module) -> tuple[list[tuple[str, Any]], list[str]]:
    """``model``'s attention modules whose processor goes through diffusers' dispatch (it has
    ``_attention_backend``), as ``(path, processor)``, and the paths of those whose processor
    calls torch's attention itself (a backend cannot reach them)."""
    classes = _attention_classes()
    through, around = [], []
    for path, module in model.named_modules():
        if not isinstance(module, classes):
            continue
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        (through if hasattr(processor, "_attention_backend") else around).append(
            (path, processor) if hasattr(processor, "_attention_backend") else path
        )
    return through, around


def describe_backend(name: str | None) -> str | None:
    """What the report says of the library's backend ``name`` (None for any other)."""
    return BACKENDS[name][1] if name in BACKENDS else None


def set_backend(model: torch.nn.Module, name: str, paths: set[str] | None = None) -> Callable[[], None]:
    """Set ``model``'s dispatching processors (those at ``paths``, None: all) to the library's
    backend ``name`` until the returned undo is called; a processor shared by several modules is
    set once."""
    value = member(name)
    held, seen = [], set()
    for path, processor in dispatching_processors(model)[0]:
        if (paths is not None and path not in paths) or id(processor) in seen:
            continue
        seen.add(id(processor))
        held.append(patch(processor, "_attention_backend", value, why=f"attention backend {name}", where="dict"))
    return lambda: [p.undo() for p in reversed(held)] and None
