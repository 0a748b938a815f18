"""What a graph reads of the weights, and whether they move between calls.

A graph reads weights by address. Loading a LoRA, ``load_state_dict`` or moving or casting the
pipeline rewrites or moves those weights; CPU offload moves them on every call. Replaying then
reads stale or freed memory. :func:`tensor_key` is what is compared per tensor (the per-call check
is :mod:`accel.hooks.state.watch`); :func:`offload_reason` says why weights move between calls.
:func:`weights_fingerprint` is the same comparison as one hash over one walk of the module, at
milliseconds per call on a 20B transformer (what the per-call check cost before the watch).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["offload_reason", "storage_tensors", "tensor_key", "weights_fingerprint"]


_ACCELERATE_OFFLOAD = "accelerate offload hooks (enable_model_cpu_offload or enable_sequential_cpu_offload)"
_GROUP_OFFLOAD = "diffusers group offloading"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _wrapper(t: torch.Tensor) -> bool:
    # A wrapper subclass (torchao's float8 weights) has no storage of its own (its address reads
    # 0 or raises) and its version does not move when its inner tensors change.
    return type(t) not in _PLAIN and hasattr(t, "__tensor_flatten__")


def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or a wrapper subclass's inner tensors."""
    if not _wrapper(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for n in names for inner in storage_tensors(getattr(t, n))]


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's identity, address and in-place version (-1 for an inference tensor); for a
    wrapper subclass, its identity and the keys of its inner tensors."""
    if _wrapper(t):
        names, _ = t.__tensor_flatten__()
        return (id(t), *(tensor_key(getattr(t, n)) for n in names))
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter
        version = -1
    return id(t), t.data_ptr(), version


def _module_offload(attrs: dict[str, Any]) -> str | None:
    if attrs.get("_hf_hook") is not None:
        return _ACCELERATE_OFFLOAD
    registry = attrs.get("_diffusers_hook")
    if registry is not None and any("offload" in name for name in registry.hooks):
        return _GROUP_OFFLOAD
    return None


def weights_fingerprint(module: torch.nn.Module) -> int:
    """A hash of every parameter's and buffer's identity, address and in-place version, and of
    PEFT's adapter switches.

    One walk over the module tree, reading instance dictionaries directly: it runs on every
    pipeline call, and on a 20B-parameter transformer ``parameters()``, ``buffers()`` and
    ``getattr`` probes (each a raised AttributeError) cost milliseconds of host time. A cast or a
    move replaces a tensor's storage (its address changes); ``load_state_dict`` and in-place
    edits bump its version; a new adapter adds tensors. The order of the walk does not count:
    cache-dit swaps a denoiser's block list in and out during a call, which moves it to the end
    of the module's children.
    """
    items: list[Any] = []
    for m in module.modules():
        for t in m._parameters.values():
            if t is not None:
                items.append(tensor_key(t))
        for t in m._buffers.values():
            if t is not None:
                items.append(tensor_key(t))
        # PEFT's LoRA layers keep adapter scales and switches as Python values, which a graph bakes in.
        scaling = m.__dict__.get("scaling")
        if isinstance(scaling, dict):
            active = getattr(m, "active_adapters", ())  # only LoRA layers get here: probes are rare
            items.append((tuple(sorted(scaling.items())), tuple(active), bool(getattr(m, "disable_adapters", False))))
    return hash(frozenset(items))


def offload_reason(module: torch.nn.Module) -> str | None:
    """Why ``module``'s weights move between calls (CPU offload of any kind), or None."""
    for m in module.modules():
        reason = _module_offload(m.__dict__)
        if reason is not None:
            return reason
    return None
