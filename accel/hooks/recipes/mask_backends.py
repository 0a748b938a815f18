"""Which diffusers attention backends take an attention mask, as diffusers' dispatch itself tells.

A processor built on diffusers' dispatch (``dispatch_attention_fn``) runs the backend it holds
(``processor._attention_backend``, set by ``set_attention_backend``) or, where it holds none, the
process-wide active one (``attention_backend(...)`` and ``set_attention_backend`` set it). Several
backends refuse a mask: the native flash kernel, flash-attn 2, 3 and 4, every sage variant, XLA's
and aiter's raise ``ValueError: `attn_mask` is not supported ...``; a backend whose function does
not name ``attn_mask`` would have it dropped by the dispatch, silently. A recipe that pads text
relies on the mask, so it must not pad under such a backend.

Nothing is guessed from backend names. diffusers' registry knows, per backend, the function it
calls and the arguments that function takes (``_supported_arg_names``, by which the dispatch
filters its keywords); :func:`backend_refusal` asks both: a function that does not name
``attn_mask`` drops it, and one that does is called once on tiny tensors of the meta device
(shapes only: no memory, no kernel) with a key-padding mask, as a padded call would give it. A
backend that answers takes masks; one that raises refuses them, with its own message; one that
cannot be called this way (a kernel missing here, an operation the meta device lacks: the varlen
backends count the mask's tokens on the host) is taken to refuse them too, which costs graph
sharing, never an image. Each backend is asked once per process (per function registered).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

__all__ = ["active_backend", "attention_processors", "backend_refusal", "backends_in_use"]

logger = logging.getLogger(__name__)

# The probe's sizes: batch 1, 4 keys (the last one padding), 2 heads of 16 channels; diffusers'
# backends take (batch, tokens, heads, channels) and a boolean key-padding mask (batch, 1, 1, keys).
_PROBE_SHAPE = (1, 4, 2, 16)


def _registry() -> Any:
    """diffusers' attention backend registry, or None where diffusers' dispatch is not imported."""
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    return getattr(dispatch, "_AttentionBackendRegistry", None)


def _name(backend: Any) -> str:
    return str(getattr(backend, "value", backend))


def active_backend() -> Any:
    """diffusers' process-wide active attention backend (None without diffusers' dispatch)."""
    registry = _registry()
    return registry._active_backend if registry is not None else None


def backends_in_use(module: torch.nn.Module) -> dict[str, list[str]]:
    """The attention backend each attention processor in ``module`` dispatches to, as
    ``{backend: [module paths]}``: the processor's own ``_attention_backend``, else the
    process-wide active one. A processor that holds no backend attribute is counted under the
    active one too: it may call the dispatch without naming a backend."""
    active = active_backend()
    found: dict[str, list[str]] = {}
    for path, processor in attention_processors(module):
        backend = getattr(processor, "_attention_backend", None) or active
        if backend is not None:
            found.setdefault(_name(backend), []).append(path)
    return found


def attention_processors(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(path, processor)`` of every attention module in ``module`` (diffusers': it has
    ``set_processor``) that holds a processor, in module order; the path of ``module`` itself is
    its class's name."""
    for path, sub in module.named_modules():
        if callable(getattr(sub, "set_processor", None)):
            processor = getattr(sub, "processor", None)
            if processor is not None:
                yield path or type(module).__name__, processor


def backend_refusal(backend: Any) -> str | None:
    """Why diffusers' attention backend ``backend`` (a name or an ``AttentionBackendName``) would
    not apply a key-padding mask, in one phrase; None where it does."""
    registry = _registry()
    if registry is None:
        return None  # no diffusers dispatch: processors call torch's attention, which takes masks
    key = _member(registry, backend)
    if key is None:
        return f"diffusers knows no attention backend {_name(backend)!r}"
    fn = registry._backends.get(key)
    if fn is None:
        return f"diffusers registered no function for attention backend {_name(backend)!r}"
    names = frozenset(registry._supported_arg_names.get(key, ()))
    return _refusal(_name(key), fn, names)


def _member(registry: Any, backend: Any) -> Hashable | None:
    for key in registry._backends:
        if key == backend or _name(key) == _name(backend):
            return key
    return None


@functools.cache
def _refusal(name: str, fn: Callable[..., Any], names: frozenset[str]) -> str | None:
    if "attn_mask" not in names:
        return f"its function {getattr(fn, '__name__', fn)!r} takes no attn_mask, which diffusers' dispatch drops"
    q = torch.empty(_PROBE_SHAPE, device="meta", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, _PROBE_SHAPE[1], device="meta", dtype=torch.bool)
    kwargs = {"query": q, "key": q, "value": q, "attn_mask": mask, "dropout_p": 0.0, "is_causal": False}
    kwargs = {k: v for k, v in kwargs.items() if k in names}
    try:
        with torch.no_grad():
            fn(**kwargs)
    except Exception as exc:  # any failure: the mask cannot be shown to work
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.debug("attention backend %s refuses a mask: %s: %s", name, type(exc).__name__, said)
        if "mask" in said:
            return f"it refuses masks ({said})"
        return f"it could not be shown to take a mask ({type(exc).__name__}: {said[:120]})"
    return None
