"""The rule of :mod:`accel.hooks.state.watch`: which values count, how they compare, what is skipped and why.

Values in a watched ``__dict__`` are of three kinds (:func:`kind`): *plain* (numbers, strings,
bools, None, dtypes, devices, enums, classes, tuples), compared by value; *containers* (dicts,
lists, sets and their subclasses), compared by their shallow content, since PEFT keeps its scales,
merged adapters, DoRA switches and active adapters in them and IP-Adapter processors keep scales
in lists; and *objects*, compared by identity.

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

Hook dictionaries are compared by what their hooks compute, in order (:func:`hook_keys`), not by
the hooks' identities or handle numbers: a Python function by its code, the contents of its
closure cells and its defaults (each by the rule above), a bound method by its object and its
function. A hook a caller registers around every call and removes after (a pipeline's
``register_forward_hook(lambda module, args, output: args[0])`` around each encode) is a new
function object with a new handle each time, yet the same hook: each registration finds the state
it had the time before, and its graphs. A hook of other code or other captured values, one added
and left, one removed, is a change as before. Other callables (a ``functools.partial``, an object
with ``__call__``) are compared by identity; the flags torch keeps beside a hook's handle
(``with_kwargs``, ``always_called``) are not compared: they follow the hook's calling convention,
which its code fixes.

Process-wide, beside the dictionaries: diffusers' active attention backend, torch's global module
hooks, and torch's settings that pick kernels (TF32, the SDPA kernel switches, autocast).

An attribute of an object's own that holds the plain value its class gives (a class attribute
along its MRO) is the same state as no attribute at all: reading it gives the same either way.
diffusers' ``reset_attention_backend`` leaves every processor an ``_attention_backend = None`` of
its own beside the class's ``None``; without this, switching a backend and back would be a third
state, captured again, instead of the first one, replayed.

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

import enum
import functools
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.modules.module as torch_module

PLAIN = "plain"
CONTAINER = "container"
OBJECT = "object"

_PLAIN_TYPES = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, type)

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


def kind(v: Any) -> str:
    if isinstance(v, (dict, list, set)):
        return CONTAINER
    if isinstance(v, _PLAIN_TYPES) or type(v) is tuple or isinstance(v, torch.Size):
        return PLAIN
    return OBJECT


def by_identity(v: Any) -> bool:
    """Whether ``v`` must be compared by identity beyond ``==``: an object whose class compares
    by value, where ``==`` could call two different objects equal (a one-element tensor; a tensor
    of more elements makes ``==`` raise, which counts as a change)."""
    if kind(v) != OBJECT:
        return False
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return type(v).__eq__ is not object.__eq__


def contents(c: Any) -> Iterable[Any]:
    return c.values() if isinstance(c, dict) else c


def copy(v: Any) -> Any:
    """``v`` as the snapshot keeps it: containers as shallow copies, anything else itself."""
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, set):
        return set(v)
    return v


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


# -- comparing and describing ------------------------------------------------------------------
class Same:
    """Compares equal only to a :class:`Same` of the very same object (and keeps it alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _rec(v: Any) -> Any:
    k = kind(v)
    if k == PLAIN:
        return v
    if k == CONTAINER:
        if isinstance(v, dict):
            return {key: _rec(x) for key, x in v.items()}
        items = [_rec(x) for x in v]
        return items if isinstance(v, list) else ("set", frozenset(Same(x) for x in v))
    return Same(v)


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` as the watch compares them (plain by value, containers by content,
    objects by identity)."""
    if a is b:
        return True
    try:
        return _rec(a) == _rec(b)
    except Exception:  # a value whose == raises: not the same
        return False


_EMPTY_CELL = object()


def _cell(cell: Any) -> Any:
    try:
        return _rec(cell.cell_contents)
    except ValueError:  # a cell not yet filled
        return Same(_EMPTY_CELL)


def hook_key(fn: Any) -> Any:
    """What a hook computes, comparable with ``==`` (see the module docstring): a function by its
    code, closure contents and defaults; a bound method by its object and function; any other
    callable by identity."""
    if isinstance(fn, types.MethodType):
        return ("method", Same(fn.__self__), hook_key(fn.__func__))
    if isinstance(fn, types.FunctionType):
        return (
            "function",
            Same(fn.__code__),
            Same(fn.__globals__),
            tuple(_cell(c) for c in fn.__closure__ or ()),
            _rec(list(fn.__defaults__ or ())),
            _rec(dict(fn.__kwdefaults__ or {})),
        )
    return Same(fn)


def hook_keys(hooks: Any) -> Any:
    """A hook dictionary by what its hooks compute, in the order they run (handle numbers left
    out); a value that is no dictionary as the rule compares any other."""
    if not isinstance(hooks, dict):
        return _rec(hooks)
    return tuple(hook_key(fn) for fn in hooks.values())


def _rec_entry(key: str, v: Any) -> Any:
    return hook_keys(v) if key in HOOK_DICTS else _rec(v)


def same_hooks(a: Any, b: Any) -> bool:
    """Two hook dictionaries as the watch compares them (:func:`hook_keys`)."""
    try:
        return bool(hook_keys(a) == hook_keys(b))
    except Exception:  # a closure value whose == raises: not the same
        return False


_ABSENT = object()


def class_value(obj: Any, key: str) -> Any:
    """The plain value ``obj``'s class gives ``key`` where ``obj`` has no attribute of its own
    (a class attribute found along the MRO), or ``_ABSENT`` (none, or not a plain value: a
    method, a property)."""
    for c in type(obj).__mro__:
        if key in c.__dict__:
            v = c.__dict__[key]
            return v if kind(v) == PLAIN else _ABSENT
    return _ABSENT


def as_class_gives(obj: Any, key: str, v: Any) -> bool:
    """Whether ``obj``'s own ``key`` holds the plain value its class gives anyway: reading the
    attribute gives the same with or without it, so it is the same state as its absence
    (diffusers' ``reset_attention_backend`` leaves ``processor._attention_backend = None``
    where before there was only the class's ``None``)."""
    if kind(v) != PLAIN:
        return False
    given = class_value(obj, key)
    return given is not _ABSENT and same(v, given)


def record(specs: list[Any], globals_seen: tuple[Any, ...]) -> Any:
    """The Python state of a look, weights left out, comparable with ``==``: an attribute that
    holds what its class gives is left out (:func:`as_class_gives`)."""
    state = {
        s.path: (Same(s.obj), {k: _rec_entry(k, v) for k, v in s.seen.items() if not as_class_gives(s.obj, k, v)})
        for s in specs
    }
    return (_rec(list(globals_seen)), state)


def show(v: Any) -> str:
    k = kind(v)
    if k == OBJECT:
        text = getattr(v, "__qualname__", None) if callable(v) and not hasattr(v, "__dict__") else None
        text = text or type(v).__name__
    else:
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


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
