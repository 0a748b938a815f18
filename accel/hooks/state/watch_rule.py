"""The rule of :mod:`accel.hooks.state.watch`: which values count, what is skipped and why.

How one value compares (plain by value, containers by content, objects by identity, hook
dictionaries by what their hooks compute, an attribute by what its class gives) is
:mod:`accel.hooks.state.watch_values`.

Skipped, each for a reason (the harmless exceptions; the ones rewritten per call were found by
calling unchanged pipelines many times with every step cache and with joined guidance branches):

* ``_parameters`` and ``_buffers``: the weights, watched apart (identity, address, version);
* ``_non_persistent_buffers_set`` and the four state-dict hook dictionaries: read by
  ``state_dict()`` and ``load_state_dict()``, never by a forward;
* ``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called``,
  ``_forward_pre_hooks_with_kwargs`` and ``_is_full_backward_hook``: flags torch writes together
  with a hook of the watched hook dictionaries, keyed by that hook's handle;
* cache-dit's statistics of the last call (:data:`CHURN`, ``_cached_steps``,
  ``_residual_diffs``...), rewritten on the denoiser and its block list every call, read by
  ``cache_dit.summary()`` only;
* ``lora_scale`` and ``_safe_fusing`` on a diffusers model: ``fuse_lora``'s arguments, which
  ``unfuse_lora`` leaves behind, read by ``fuse_lora``'s own apply only;
* a diffusers hook registry's ``_child_registries_cache``: rebuilt lazily, from what is watched;
* an attribute a model's forward reads in one method only, while that method runs as an eager
  break (:data:`READ_IN_BREAK`): a break runs at every replay and reads the attribute as it is
  then, so no graph holds it. transformers' Qwen-VL models keep the M-RoPE deltas of their last
  call with an image in ``rope_deltas`` (for generation's later steps): a new tensor at every such
  call, read in a forward by ``compute_3d_position_ids`` alone. Without that method marked (a
  recipe's known break), the attribute is watched as any other;
* the watched module's own forward hooks (:data:`AROUND_THE_GRAPHS`): torch runs them around the
  module's ``forward``, where the graphs replay, so they run at every call and none is in a graph
  (a profiler's or a benchmark's timing hooks on the denoiser). Its submodules' hooks run inside
  the captured forward and are watched.

Compared more cheaply, not skipped: an empty hook dictionary can only gain a hook through a
handle, numbered from one global counter; an empty child, parameter or buffer dictionary gains an
entry only under a name the forward did not read when it was captured (but a ``ModuleDict`` or
``ModuleList``, read by content, is compared even empty).

Process-wide, beside the dictionaries: diffusers' active attention backend, torch's global module
hooks, and torch's settings that pick kernels (TF32, the SDPA kernel switches, autocast).

Not watched, said plainly: class attributes and other module globals; the inside of objects held
by identity (a RoPE table holder, a function's closure, a hook object's settings); a value
replaced by a different object that compares equal to it (a number by a one-element tensor of the
same value); weight writes through ``.data``, which bump no version (a replay reads them at their
address, which is right for weights on the graphs' device); a hook put into a module's hook
dictionary by hand rather than through ``register_*_hook``. An object whose state is not in a
``__dict__`` (one with ``__slots__``, a C type) cannot be watched at all: :func:`unwatchable`
says so, and graphs are refused for its module.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.nn.modules.module as torch_module

from .watch_values import OBJECT, Same, as_class_gives, comparable, copy, hook_keys, kind, same, same_hooks, show

WEIGHT_KEYS = ("_parameters", "_buffers")
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# The hooks torch runs around a module's forward, outside the graphs the forward replays: not
# watched on the watched module itself.
AROUND_THE_GRAPHS = frozenset({"_forward_hooks", "_forward_pre_hooks"})
# Modules their owners read by content: compared even while empty.
CONTAINER_MODULES = (
    torch.nn.ModuleDict,
    torch.nn.ModuleList,
    torch.nn.Sequential,
    torch.nn.ParameterDict,
    torch.nn.ParameterList,
)
# Dictionaries left out of the fast check while empty (see accel.hooks.state.watch).
SPARSE = frozenset({*HOOK_DICTS, "_modules"})
IGNORED = frozenset(
    {
        *WEIGHT_KEYS,
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_is_full_backward_hook",
    }
)
# Entries rewritten by every call that do not change the forward (see the module docstring):
# cache-dit's statistics of the last call (``apply_stats``, on the denoiser and its block list),
# read by ``cache_dit.summary()``, never by a forward.
CHURN = frozenset(
    {
        f"_{cfg}{stat}"
        for cfg in ("", "cfg_")
        for stat in (
            "cached_steps",
            "residual_diffs",
            "accumulated_cached_steps",
            "pruned_steps",
            "pruned_blocks",
            "actual_blocks",
            "pruned_ratio",
        )
    }
    | {"_accumulated_executed_steps", "_accumulated_transformer_executed_steps"}
)
# Left on a diffusers model by the calls that set them, read by those calls only: fuse_lora's
# arguments (PeftAdapterMixin.fuse_lora keeps them for its own apply; unfuse_lora leaves them).
_LEFT_BY = {"PeftAdapterMixin": frozenset({"lora_scale", "_safe_fusing"})}
# A diffusers hook registry caches which submodules carry registries, and rebuilds it lazily.
_REGISTRY_CHURN = frozenset({"_child_registries_cache"})
# Keys of a module's dictionary holding an object whose own dictionary is watched too: the
# attention processor, diffusers' hook registry, and a transformers config (which holds the
# attention implementation; diffusers' configs are dicts, watched by their content anyway).
OWNERS = ("processor", "_diffusers_hook", "config")
# An offload root (the VAE of a watched decoder) is watched only where offload hooks go.
_OFFLOAD_KEYS = ("_hf_hook", "_diffusers_hook", "forward")

_TORCH_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


# Torch modules whose forward reads nothing of their own dictionary but their tensors and hooks
# (exactly these classes: a subclass may read more): their sizes and training flag do not decide
# what a capture recorded, so the per-call check leaves them out (a look still records them).
# Linear is most of a DiT's modules (846 of Qwen-Image's 2,297).
_UNREAD_BY = {
    torch.nn.Linear: frozenset({"in_features", "out_features", "training"}),
    torch.nn.Identity: frozenset({"training"}),
}
_NONE: frozenset[str] = frozenset()


def unread(obj: Any) -> frozenset[str]:
    """Keys of ``obj``'s dictionary that its forward never reads (see ``_UNREAD_BY``)."""
    return _UNREAD_BY.get(type(obj), _NONE)


# class name -> {attribute: the one method that reads it in a forward}: not watched while that
# method is an eager break (see the module docstring).
READ_IN_BREAK: dict[str, dict[str, str]] = {
    name: {"rope_deltas": "compute_3d_position_ids"}
    for name in ("Qwen2VLModel", "Qwen2_5_VLModel", "Qwen3VLModel", "Qwen3VLMoeModel")
}


def _read_in_break(obj: Any) -> frozenset[str]:
    cls = type(obj)
    return frozenset(
        attr
        for c in cls.__mro__
        for attr, method in READ_IN_BREAK.get(c.__name__, {}).items()
        if getattr(getattr(cls, method, None), "__bcg_eager__", False)
    )


def module_keys(obj: Any, d: dict[str, Any]) -> list[str]:
    left = frozenset().union(*(keys for c in type(obj).__mro__ for n, keys in _LEFT_BY.items() if c.__name__ == n))
    left |= _read_in_break(obj)
    return [k for k in d if k not in IGNORED and k not in CHURN and k not in left]


def object_keys(d: dict[str, Any]) -> list[str]:
    return [k for k in d if k not in CHURN and k not in _REGISTRY_CHURN]


def offload_keys(d: dict[str, Any]) -> list[str]:
    return [k for k in _OFFLOAD_KEYS if k in d]


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def unwatchable(obj: Any) -> str | None:
    """Why ``obj``'s state cannot be watched (not all of it is in its ``__dict__``), or None."""
    slots = _data_slots(type(obj))
    if slots:
        return f"it keeps state in __slots__ ({', '.join(slots[:3])})"
    if not hasattr(obj, "__dict__"):
        return "its state is not in a __dict__"
    return None


@functools.lru_cache(maxsize=512)
def _data_slots(cls: type) -> tuple[str, ...]:
    return tuple(s for c in cls.__mro__ for s in _slots(c) if s not in ("__dict__", "__weakref__"))


def _slots(cls: type) -> tuple[str, ...]:
    s = cls.__dict__.get("__slots__", ())
    return (s,) if isinstance(s, str) else tuple(s)


# -- process-wide switches -------------------------------------------------------------------
def _attention_registry() -> Any:
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    return getattr(dispatch, "_AttentionBackendRegistry", None)


def _torch_switches() -> tuple[Any, ...]:
    """torch's process- and thread-wide settings that pick the kernels a capture records."""
    cuda, matmul = torch.backends.cuda, torch.backends.cuda.matmul
    return (
        matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


_TORCH_SWITCHES = (
    "torch.backends.cuda.matmul.allow_tf32",
    "torch.backends.cudnn.allow_tf32",
    "torch's float32 matmul precision",
    "torch's bf16 reduced-precision reductions",
    "torch's fp16 reduced-precision reductions",
    "torch's flash SDPA switch",
    "torch's memory-efficient SDPA switch",
    "torch's math SDPA switch",
    "torch's cuDNN SDPA switch",
    "autocast on CUDA",
    "autocast's CUDA dtype",
    "autocast on the CPU",
    "autocast's CPU dtype",
)


def globals_now() -> tuple[Any, ...]:
    """diffusers' active attention backend and checks switch, torch's global module hooks, and
    torch's settings that pick kernels (TF32, the SDPA kernels, autocast)."""
    registry = _attention_registry()
    backend = (registry._active_backend, registry._checks_enabled) if registry is not None else (None, None)
    return (*backend, *(getattr(torch_module, name) for name in _TORCH_GLOBAL_HOOKS), *_torch_switches())


def copy_globals(g: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(copy(v) for v in g)


def global_differences(old: tuple[Any, ...], new: tuple[Any, ...]) -> list[str]:
    names = ("diffusers' active attention backend", "diffusers' attention checks")
    names += tuple(f"torch's {n[1:].replace('_', ' ')}" for n in _TORCH_GLOBAL_HOOKS)
    names += _TORCH_SWITCHES
    return [f"{name} changed ({show(o)} -> {show(n)})" for name, o, n in zip(names, old, new) if not same(o, n)]


# -- a look's record, and what changed between two looks -----------------------------------------
def _rec_entry(key: str, v: Any) -> Any:
    return hook_keys(v) if key in HOOK_DICTS else comparable(v)


def record(specs: list[Any], globals_seen: tuple[Any, ...]) -> Any:
    """The Python state of a look, weights left out, comparable with ``==``: an attribute that
    holds what its class gives is left out (:func:`as_class_gives`)."""
    state = {
        s.path: (Same(s.obj), {k: _rec_entry(k, v) for k, v in s.seen.items() if not as_class_gives(s.obj, k, v)})
        for s in specs
    }
    return (comparable(list(globals_seen)), state)


def _children(path: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for name in dict.fromkeys([*old, *new]):
        o, n = old.get(name), new.get(name)
        if o is n:
            continue
        where = join(path, name)
        if name not in old:
            out.append(f"{where} added ({show(n)})")
        elif name not in new:
            out.append(f"{where} removed")
        else:
            out.append(f"{where} replaced ({show(o)} -> {show(n)})")
    return out


def _entry(path: str, key: str, old: Any, new: Any, missing: Any) -> list[str]:
    where = join(path, key)
    if key == "_modules" and isinstance(old, dict) and isinstance(new, dict):
        return _children(path, old, new)
    if key in HOOK_DICTS:
        label = key.strip("_").replace("_", " ")
        return [f"{path or 'the module'}: {label} changed ({len(old or ())} -> {len(new or ())})"]
    if old is missing:
        return [f"{where} set ({show(new)})"]
    if new is missing:
        return [f"{where} removed"]
    if kind(old) == OBJECT and kind(new) == OBJECT and type(old) is type(new) and old is not new:
        return [f"{where} changed (another {show(new)})"]
    return [f"{where} changed ({show(old)} -> {show(new)})"]


def differences(old_specs: list[Any], new_specs: list[Any]) -> list[str]:
    """What changed between two looks, one phrase each, in the order of the walk."""
    missing = object()
    old = {s.path: s for s in old_specs}
    out: list[str] = []
    for s in new_specs:
        o = old.get(s.path)
        if o is None or o.obj is not s.obj:
            continue  # new here: its parent's entry (a child, a processor) says so
        for key in dict.fromkeys([*o.seen, *s.seen]):
            a, b = o.seen.get(key, missing), s.seen.get(key, missing)
            if key in HOOK_DICTS:
                a, b = (a if a is not missing else {}), (b if b is not missing else {})
                if same_hooks(a, b):
                    continue
            elif a is not missing and b is not missing and same(a, b):
                continue
            elif (a is missing and as_class_gives(s.obj, key, b)) or (b is missing and as_class_gives(s.obj, key, a)):
                continue  # an attribute of its own set to, or removed from, what its class gives
            out += _entry(s.path, key, a, b, missing)
    return out
