"""Marking functions as eager breaks, and what a marked function answers to.

A function marked with :func:`eager_on_graph` asks the thread's active context (a context
variable) what to do: none (a plain call), a capture (:mod:`accel.graphs.bcg`: the call becomes
a break) or a re-run (:func:`rerun`: the call's first breaks return what they returned before).
See :mod:`accel.graphs.bcg` for the contract.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from . import tree
from .errors import BreakError

__all__ = [
    "Memo",
    "OutputStructure",
    "break_graph",
    "check_decision",
    "eager_on_graph",
    "is_capturing",
    "rerun",
    "structure_key",
]

F = TypeVar("F", bound=Callable[..., Any])


class Active(Protocol):
    """What a marked function calls while a capture or a re-run is active in its thread."""

    capturing: bool

    def run_break(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kind: BreakKind
    ) -> Any: ...


@dataclasses.dataclass(frozen=True)
class BreakKind:
    """How a marked function behaves as a break."""

    inline_nested: bool = False
    decision: bool = False
    keeps_inputs: bool = False
    keyed: bool = False


# What this thread's marked functions answer to: an open capture, a re-run, or nothing (plain calls).
ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar("bcg_active_capture", default=None)


def is_capturing() -> bool:
    """True while a breakable capture is active in this thread (also while a break runs in it)."""
    active = ACTIVE.get()
    return active is not None and active.capturing


def eager_on_graph(
    fn: F | None = None,
    *,
    name: str | None = None,
    inline_nested: bool = False,
    decision: bool = False,
    keeps_inputs: bool = False,
    keyed: bool = False,
) -> Any:
    """Mark ``fn`` as an eager break.

    Usable as ``@eager_on_graph`` or ``@eager_on_graph(name="...")``. Outside a capture the
    wrapper is ``fn`` itself (one context-variable lookup more). ``inline_nested=True`` lets
    marked functions called from inside ``fn`` run as plain calls instead of raising
    :class:`NestedBreakError`; the debug mode uses it to run a whole forward as one break.
    ``decision=True``: ``fn`` returns a small host value that picks the continuation (see the
    module's contract). ``keeps_inputs=True``: ``fn`` keeps its tensor arguments, so under a
    capture it gets owned copies of them. ``keyed=True``: the structure of ``fn``'s output (its
    tree, tensor shapes and dtypes, constants: :func:`structure_key`) is a decision too, so an
    output of another shape replays (or captures) a chain of its own instead of running the
    call eagerly (a function that computes data-dependent shapes from a mask).
    """
    kind = BreakKind(inline_nested, decision, keeps_inputs, keyed)

    def decorate(f: F) -> F:
        label = name or getattr(f, "__qualname__", None) or repr(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cap = ACTIVE.get()
            if cap is None:
                return f(*args, **kwargs)
            return cap.run_break(f, label, args, kwargs, kind)

        wrapper.__bcg_eager__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


_DECISION_TYPES = (bool, int, str, type(None))


def check_decision(value: Any, name: str) -> Any:
    """``value`` if it can be a decision (a small hashable host value), else BreakError naming the break."""
    if isinstance(value, _DECISION_TYPES) or (
        isinstance(value, tuple) and all(isinstance(v, _DECISION_TYPES) for v in value)
    ):
        return value
    raise BreakError(
        f"decision {name!r} returned a {type(value).__name__}; a decision returns a bool, an int, a string, "
        "None, or a tuple of those"
    )


def _leaf_key(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:
        return ("unhashable", type(leaf), repr(leaf))
    return ("constant", type(leaf), leaf)


def _leaf_label(key: Hashable) -> str:
    kind, what, value = key  # type: ignore[misc]
    if isinstance(kind, tuple):  # a tensor's (shape, dtype, device)
        return f"{'x'.join(map(str, kind)) or 'scalar'} {str(what).removeprefix('torch.')}"
    return value if kind == "unhashable" else repr(value)


@dataclasses.dataclass(frozen=True)
class OutputStructure:
    """A keyed break's decision value: its output's tree, each tensor's shape, dtype and device,
    each constant's value (two outputs with one structure fit one boundary buffer). Compared on
    every replay, so it is built from the cheapest walk of the output; its text is for reports."""

    spec: Hashable
    leaves: tuple[Hashable, ...]

    def __str__(self) -> str:
        return ", ".join(_leaf_label(k) for k in self.leaves)


def structure_key(value: Any) -> OutputStructure:
    """The :class:`OutputStructure` of a keyed break's output."""
    leaves, spec = tree.flatten_key(value)
    return OutputStructure(spec, tuple(_leaf_key(leaf) for leaf in leaves))


class Memo:
    """What the first breaks of a call returned, in order, for running the call again.

    ``entries`` is a list of ``(name, value)``; :meth:`take` hands them out in order and checks
    that the same break asks for each (the code took another way otherwise, and nothing of the
    rest could be trusted).
    """

    def __init__(self, entries: list[tuple[str, Any]]) -> None:
        self.entries = list(entries)
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def fresh(self) -> Memo:
        """The same entries, handed out from the start again."""
        return Memo(self.entries)

    @property
    def pending(self) -> bool:
        return self._next < len(self.entries)

    def take(self, name: str) -> Any:
        want, value = self.entries[self._next]
        if want != name:
            raise BreakError(
                f"running a call again reached break {name!r} where the first run had {want!r} "
                f"(break {self._next}): the call is not deterministic"
            )
        self._next += 1
        return value


class _Rerun:
    """Marked functions during a call run again outside any capture: the memo's breaks return
    their recorded values, later ones run as plain calls."""

    capturing = False

    def __init__(self, memo: Memo) -> None:
        self.memo = memo

    def run_break(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], kind: BreakKind
    ) -> Any:
        if self.memo.pending:
            return self.memo.take(name)
        return fn(*args, **kwargs)


@contextlib.contextmanager
def rerun(memo: Memo | None) -> Iterator[None]:
    """Run a call again whose first breaks already ran: each of them returns its value from
    ``memo`` instead of running (see the module's contract). ``None``: nothing to skip."""
    if memo is None or not len(memo):
        yield
        return
    token = ACTIVE.set(_Rerun(memo.fresh()))
    try:
        yield
    finally:
        ACTIVE.reset(token)


@eager_on_graph(name="break_graph")
def _empty_break() -> None:
    return None


def break_graph() -> None:
    """Force a segment boundary here (a no-op outside a capture)."""
    _empty_break()
