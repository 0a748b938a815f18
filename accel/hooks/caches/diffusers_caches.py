"""Rules for diffusers' own step caches: FirstBlockCache, TaylorSeer and MagCache (0.42).

Each is applied the diffusers way (``transformer.enable_cache(config)`` or ``apply_*(module,
config)``) and keeps its state in ``StateManager``s, one state object per guidance branch,
rebuilt at every pipeline call. The rules here turn their decisions into decision breaks, their
host bookkeeping into eager breaks, and the tensors they keep into fixed buffers or owned copies
(see :mod:`accel.hooks.caches.rules`); their arithmetic is captured unchanged.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch
from diffusers.hooks.hooks import CacheContext

from .rules import CacheRule, decision, effect, register_rule
from .slots import Slots

__all__ = ["FirstBlockCacheRule", "MagCacheRule", "TaylorSeerRule"]


# --------------------------------------------------------------------------------------------
# State managers: snapshots, fixed buffers for tensor attributes
# --------------------------------------------------------------------------------------------
def _copy_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    # One level deep: the caches rebind their tensors and replace inner containers, but append to
    # lists and add keys to dicts in place.
    return {k: copy.copy(v) if isinstance(v, (dict, list)) else v for k, v in attrs.items()}


def snapshot_manager(manager: Any) -> Any:
    """A diffusers ``StateManager``'s context and states, to come back to (tensors not copied:
    the caches replace them, never write into them)."""
    return manager._context, {name: (state, _copy_attrs(vars(state))) for name, state in manager._state_cache.items()}


def restore_manager(manager: Any, snapshot: Any) -> None:
    context, states = snapshot
    manager._context = context
    manager._state_cache = {}
    for name, (state, saved) in states.items():
        vars(state).clear()
        vars(state).update(_copy_attrs(saved))
        manager._state_cache[name] = state


def context_name(manager: Any) -> Hashable:
    context = manager._context
    return None if context is None else getattr(context, "name", context)


class SlottedState:
    """Routes a diffusers cache state's tensor attributes into :class:`Slots` while installed.

    The state class of ``manager`` is swapped for a subclass whose ``__setattr__`` stores the
    listed attributes through an eager break: at every replay the break copies the new value into
    the buffer of (branch, attribute) and sets the attribute of the branch's current state object
    to it, so the graphs that read the attribute (captured against the buffer) see this step's
    value. Undo puts the class back.
    """

    def __init__(self, manager: Any, attrs: frozenset[str], label: str) -> None:
        self.manager = manager
        self.attrs = attrs
        self.slots = Slots()
        self._original = manager._state_cls
        store = effect(self._store, f"{label}: keep state")
        names = attrs

        def __setattr__(state: Any, name: str, value: Any) -> None:
            if name in names and value is not None:
                store(name, value)
            else:
                object.__setattr__(state, name, value)

        self.cls = type(f"Slotted{self._original.__name__}", (self._original,), {"__setattr__": __setattr__})

    def _store(self, name: str, value: Any) -> None:
        state = self.manager.get_state()
        object.__setattr__(state, name, self.slots.store(context_name(self.manager), name, value))

    def install(self) -> Callable[[], None]:
        self.manager._state_cls = self.cls
        for state in self.manager._state_cache.values():
            state.__class__ = self.cls

        def undo() -> None:
            self.manager._state_cls = self._original
            for state in self.manager._state_cache.values():
                if type(state) is self.cls:
                    state.__class__ = self._original

        return undo

    def snapshot(self) -> Any:
        return snapshot_manager(self.manager), self.slots.snapshot()

    def restore(self, snapshot: Any) -> None:
        managed, slots = snapshot
        restore_manager(self.manager, managed)
        self.slots.restore(slots)


def _by_manager(hooks: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    groups: dict[int, list[tuple[str, Any]]] = {}
    for path, hook in hooks:
        groups.setdefault(id(hook.state_manager), []).append((path, hook))
    return list(groups.values())


def _shadow(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set an instance attribute over a method; the undo removes it (or restores one it hid)."""
    previous = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)

    def undo() -> None:
        if previous is _MISSING:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, previous)

    return undo


_MISSING = object()


def _undo_all(undo: list[Callable[[], None]]) -> Callable[[], None]:
    """One undo for several, run last to first."""

    def run() -> None:
        while undo:
            undo.pop()()

    return run


class _SlottedRule(CacheRule):
    """A cache whose hooks share one StateManager and keep tensors in a :class:`SlottedState`
    (set ``self.manager`` and ``self.state`` in :meth:`install`)."""

    manager: Any
    state: SlottedState

    @classmethod
    def group(cls, hooks: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
        return _by_manager(hooks)

    def snapshot(self) -> Any:
        return self.state.snapshot()

    def restore(self, snapshot: Any) -> None:
        self.state.restore(snapshot)

    def context(self) -> Hashable:
        return context_name(self.manager)


# --------------------------------------------------------------------------------------------
# FirstBlockCache
# --------------------------------------------------------------------------------------------
@register_rule
class FirstBlockCacheRule(_SlottedRule):
    """The head block's residual check is the decision; the head's output and residual and the
    tail's residuals live in fixed buffers."""

    label = "FirstBlockCache"
    hook_classes = ("FBCHeadBlockHook", "FBCBlockHook")

    def install(self) -> Callable[[], None]:
        head = next(h for _, h in self.hooks if type(h).__name__ == "FBCHeadBlockHook")
        self.manager = head.state_manager
        self.state = SlottedState(
            self.manager, frozenset({"head_block_output", "head_block_residual", "tail_block_residuals"}), self.label
        )
        check = type(head)._should_compute_remaining_blocks.__get__(head)
        n = len(self.hooks)

        def compute_remaining(residual: torch.Tensor) -> bool:
            compute = self.forced("head", check(residual), False)
            self.counts.add(compute, n if compute else 1, 0 if compute else n - 1)
            return compute

        undo = [
            self.state.install(),
            _shadow(
                head,
                "_should_compute_remaining_blocks",
                decision(compute_remaining, f"{self.label}: compute the remaining blocks"),
            ),
        ]
        return _undo_all(undo)


# --------------------------------------------------------------------------------------------
# TaylorSeer
# --------------------------------------------------------------------------------------------
class _TaylorState:
    """What a TaylorSeer hook calls on its state, as eager breaks on the branch's current state."""

    def __init__(self, hook: Any, path: str) -> None:
        manager = hook.state_manager
        self.update = effect(
            lambda outputs: manager.get_state().update(outputs), f"TaylorSeer {path}: update", keeps_inputs=True
        )
        self.predict = effect(lambda: manager.get_state().predict(), f"TaylorSeer {path}: predict")


@register_rule
class TaylorSeerRule(CacheRule):
    """Each hooked module's step counter is a decision; its Taylor factors are updated and its
    prediction made in eager breaks (from owned copies of the module's outputs)."""

    label = "TaylorSeer"
    hook_classes = ("TaylorSeerCacheHook",)

    def install(self) -> Callable[[], None]:
        undo = []
        for i, (path, hook) in enumerate(self.hooks):
            measure = type(hook)._measure_should_compute.__get__(hook)

            def compute(measure: Callable[[], Any] = measure, first: bool = i == 0, site: str = path) -> bool:
                should = self.forced(site, bool(measure()[0]), False)
                self.counts.add(should, int(should), int(not should), step=first)
                return should

            decide = decision(compute, f"{self.label} {path}: compute")
            proxy = _TaylorState(hook, path)
            undo.append(_shadow(hook, "_measure_should_compute", lambda decide=decide, proxy=proxy: (decide(), proxy)))
        return _undo_all(undo)

    def snapshot(self) -> Any:
        return [snapshot_manager(h.state_manager) for _, h in self.hooks]

    def restore(self, snapshot: Any) -> None:
        for (_, hook), snap in zip(self.hooks, snapshot):
            restore_manager(hook.state_manager, snap)

    def context(self) -> Hashable:
        return context_name(self.hooks[0][1].state_manager)


# --------------------------------------------------------------------------------------------
# MagCache
# --------------------------------------------------------------------------------------------
def _mag_decide(hook: Any, state: Any) -> bool:
    """MagCacheHeadHook.new_forward's decision and bookkeeping (diffusers 0.42), on ``state``."""
    config = hook.config
    if config.calibrate:
        return True
    current_step = state.step_index
    current_scale = 1.0 if current_step >= len(config.mag_ratios) else config.mag_ratios[current_step]
    retention_step = int(config.retention_ratio * config.num_inference_steps + 0.5)
    if current_step < retention_step:
        return True
    state.accumulated_ratio *= current_scale
    state.accumulated_steps += 1
    state.accumulated_err += abs(1.0 - state.accumulated_ratio)
    if (
        state.previous_residual is not None
        and state.accumulated_err <= config.threshold
        and state.accumulated_steps <= config.max_skip_steps
    ):
        return False
    state.accumulated_ratio = 1.0
    state.accumulated_steps = 0
    state.accumulated_err = 0.0
    return True


def _mag_cached_output(hook: Any, state: Any, hidden_states: torch.Tensor, args: Any, kwargs: Any) -> Any:
    """MagCacheHeadHook.new_forward's skip branch (diffusers 0.42): input plus last residual."""
    output = hidden_states
    res = state.previous_residual
    if res.device != output.device:
        res = res.to(output.device)
    if res.shape == output.shape:
        output = output + res
    elif output.ndim == 3 and res.ndim == 3 and output.shape[0] == res.shape[0] and output.shape[2] == res.shape[2]:
        diff = output.shape[1] - res.shape[1]
        if diff > 0:
            output = output.clone()
            output[:, diff:, :] = output[:, diff:, :] + res
    metadata = hook._metadata
    if metadata.return_encoder_hidden_states_index is not None:
        encoder = metadata._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
        ret = [None] * (max(metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index) + 1)
        ret[metadata.return_hidden_states_index] = output
        ret[metadata.return_encoder_hidden_states_index] = encoder
        return tuple(ret)
    return output


def _fn_ref_of(module: torch.nn.Module, hook: Any) -> Any:
    registry = module._diffusers_hook
    for name, fn_ref in zip(registry._hook_order, registry._fn_refs):
        if registry.hooks[name] is hook:
            return fn_ref
    raise ValueError(f"{type(hook).__name__} is not registered on {type(module).__name__}")


@register_rule
class MagCacheRule(_SlottedRule):
    """The head hook's magnitude-ratio bookkeeping is the decision; the head's input and the tail's
    residual live in fixed buffers; the tail's step advance and calibration run as eager breaks."""

    label = "MagCache"
    hook_classes = ("MagCacheHeadHook", "MagCacheBlockHook")

    def install(self) -> Callable[[], None]:
        head_path, head = next((p, h) for p, h in self.hooks if type(h).__name__ == "MagCacheHeadHook")
        self.manager = manager = head.state_manager
        self.state = SlottedState(manager, frozenset({"previous_residual", "head_block_input"}), self.label)
        n = len(self.hooks)

        def decide_now() -> bool:
            state = manager.get_state()
            compute = self.forced("head", _mag_decide(head, state), False)
            state.should_compute = compute
            self.counts.add(compute, n if compute else 0, 0 if compute else n)
            return compute

        decide = decision(decide_now, f"{self.label}: compute the blocks")

        def head_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if manager._context is None:
                manager.set_context(CacheContext(name="inference"))
            hidden = head._metadata._get_parameter_from_args_kwargs(
                head._metadata.hidden_states_argument_name, args, kwargs
            )
            state = manager.get_state()
            state.head_block_input = hidden
            compute = decide()
            state.should_compute = compute
            if not compute:
                return _mag_cached_output(head, state, hidden, args, kwargs)
            return head.fn_ref.original_forward(*args, **kwargs)

        head_module = self.module.get_submodule(head_path)
        fn_ref = _fn_ref_of(head_module, head)
        previous = fn_ref.forward
        fn_ref.forward = functools.partial(head_forward, head_module)
        undo: list[Callable[[], None]] = [self.state.install()]
        undo.append(lambda: setattr(fn_ref, "forward", previous))
        for path, hook in self.hooks:
            if type(hook).__name__ != "MagCacheBlockHook":
                continue
            advance = type(hook)._advance_step.__get__(hook)
            calibrate = type(hook)._perform_calibration_step.__get__(hook)
            step = effect(lambda advance=advance: advance(manager.get_state()), f"{self.label} {path}: next step")
            measure = effect(
                lambda residual, calibrate=calibrate: calibrate(manager.get_state(), residual),
                f"{self.label} {path}: calibrate",
                keeps_inputs=True,
            )
            undo.append(_shadow(hook, "_advance_step", lambda state, step=step: step()))
            undo.append(_shadow(hook, "_perform_calibration_step", lambda state, residual, m=measure: m(residual)))
        return _undo_all(undo)
