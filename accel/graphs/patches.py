"""Reversible patches: the one way the library changes code and settings it does not own.

:func:`patch` puts a value in a place and returns a :class:`Patch`; :meth:`Patch.undo` takes it
away again. A place is an attribute (``where="attr"``: ``setattr``; for modules, classes and settings
objects), an object's own instance dictionary (``where="dict"``: bypasses a ``__setattr__``, as
a pipeline's must be) or a mapping item (``where="item"``: ``os.environ``, a settings table).

Patches of one place stack: the newest one still in place is in effect, and undoing any of them,
in any order, leaves the newest remaining one (or, after the last, what the place held before
the first) in effect. So patches that many holders need (a module-level helper marked by every
denoiser of a model family) are taken once per holder and last while any holder lives.
:func:`active` lists the places patched now, for reports.

Whoever patches undoes: every install of the library returns its undo, and a patch lasts only
as long as what needs it (a capture, a call, a session, an accelerated module). A patch nobody
holds any more is undone when it is collected, so a pipeline dropped without ``restore()`` takes
its marks with it; the registry holds places weakly and so keeps nothing alive.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Literal

__all__ = ["MISSING", "Patch", "active", "patch", "placed", "unpatched"]

Where = Literal["attr", "dict", "item"]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()  # what a place held before it was patched, when it held nothing

_lock = threading.RLock()
# Weak values: a place lives while a patch of it does (each patch holds its place), so the registry
# never keeps a patched value alive, nor what that value refers to (a dropped pipeline's models).
_places: weakref.WeakValueDictionary[tuple[int, str, Any], _Place] = weakref.WeakValueDictionary()


class Patch:
    """One patch of one place; :meth:`undo` is idempotent. Also a context manager (undone on exit).

    Attributes:
        value: what this patch puts in the place.
        why: a short phrase for reports (``"scheduler.step as an eager break"``).
        original: what the place held before the first patch of it (:data:`MISSING` if nothing).
    """

    __slots__ = ("_place", "value", "why")

    def __init__(self, place: _Place, value: Any, why: str) -> None:
        self._place = place
        self.value = value
        self.why = why

    @property
    def original(self) -> Any:
        return self._place.original

    @property
    def in_place(self) -> bool:
        """Not undone yet."""
        return self in self._place.layers

    def undo(self) -> None:
        with _lock:
            self._place.remove(self)

    def __del__(self) -> None:
        # Nothing holds this patch any more, so nothing needs it: what patched (a pipeline the
        # user dropped without restoring it) is gone, and a mark of a module's function must not
        # outlive it. Patches that last are held by whoever made them.
        try:
            self.undo()
        except Exception:  # interpreter shutdown: the place may be half torn down
            pass

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


class _Place:
    def __init__(self, target: Any, name: Any, where: Where, key: tuple[int, str, Any]) -> None:
        # Held strongly: only patches hold their place (the registry's values are weak), so this
        # keeps a target alive no longer than its patches, and a patch collected with its place
        # can still write the original back (the collector clears weak references first).
        self._target = target
        self.key = key
        self.name = name
        self.where = where
        self.original = self._read(target)
        self.layers: list[Patch] = []

    @property
    def label(self) -> str:
        return _label(self._target, self.name, self.where)

    def _read(self, target: Any) -> Any:
        return self._read_value(target, self.name, self.where)

    @staticmethod
    def _read_value(target: Any, name: Any, where: Where) -> Any:
        if where == "item":
            return target.get(name, MISSING) if hasattr(target, "get") else MISSING
        if where == "dict":
            return vars(target).get(name, MISSING)
        own = getattr(target, "__dict__", None)
        if own is not None and name in own:
            return own[name]  # as stored: a staticmethod stays one
        if isinstance(target, type):
            return MISSING  # inherited: taking ours away lets the lookup find the base's again
        return getattr(target, name, MISSING)  # a module's __getattr__, a settings object

    def _write(self, target: Any, value: Any) -> None:
        if self.where == "item":
            if value is MISSING:
                target.pop(self.name, None)
            else:
                target[self.name] = value
        elif self.where == "dict":
            if value is MISSING:
                target.__dict__.pop(self.name, None)
            else:
                target.__dict__[self.name] = value
        elif value is MISSING:
            if hasattr(target, self.name):
                delattr(target, self.name)
        else:
            setattr(target, self.name, value)

    def add(self, layer: Patch) -> None:
        self._write(self._target, layer.value)
        self.layers.append(layer)

    def remove(self, layer: Patch) -> None:
        if layer not in self.layers:
            return
        top = self.layers[-1] is layer
        self.layers.remove(layer)
        if top:
            self._write(self._target, self.layers[-1].value if self.layers else self.original)
        if not self.layers:
            _places.pop(self.key, None)


def _label(target: Any, name: Any, where: Where) -> str:
    if isinstance(target, type) or hasattr(target, "__spec__"):  # a class or a module
        owner = (
            f"{getattr(target, '__module__', '') or ''}.{target.__qualname__}"
            if isinstance(target, type)
            else target.__name__
        )
        owner = owner.lstrip(".")
    elif where == "item" and type(target).__name__ == "_Environ":
        owner = "os.environ"
    else:
        owner = f"a {type(target).__name__}"
    return f"{owner}[{name!r}]" if where == "item" else f"{owner}.{name}"


def patch(target: Any, name: Any, value: Any, *, why: str, where: Where = "attr") -> Patch:
    """Put ``value`` at ``target``'s ``name`` (see the module's docstring for ``where``) until the
    returned patch is undone."""
    key = (id(target), where, name)
    with _lock:
        place = _places.get(key)
        if place is None or place._target is not target:
            place = _Place(target, name, where, key)
        layer = Patch(place, value, why)
        place.add(layer)  # raises, changing nothing, where the place cannot be written
        _places[key] = place
        return layer


def unpatched(target: Any, name: Any, where: Where = "attr") -> Any:
    """What ``target``'s ``name`` holds without this library's patches: the value before the
    first patch of it (:data:`MISSING` if none), or the current value where it is not patched.
    Wrap this, not the current value, to add a patch that must not wrap another one."""
    with _lock:
        place = _places.get((id(target), where, name))
        if place is not None and place._target is target:
            return place.original
        return _Place._read_value(target, name, where)


def placed(target: Any, name: Any, where: Where = "attr") -> bool:
    """Whether what ``target``'s ``name`` holds now is this library's: the value of the patch in
    effect there (not something written over it since)."""
    with _lock:
        place = _places.get((id(target), where, name))
        if place is None or place._target is not target or not place.layers:
            return False
        return _Place._read_value(target, name, where) is place.layers[-1].value


def active() -> list[str]:
    """One line per place patched now: why, and where (the count of holders if several)."""
    with _lock:
        places = sorted(list(_places.values()), key=lambda p: p.label)
        lines = []
        for place in places:
            layers = list(place.layers)
            whys = list(dict.fromkeys(layer.why for layer in layers))
            held = f" (held {len(layers)} times)" if len(layers) > 1 else ""
            lines.append(f"{'; '.join(whys)}: {place.label}{held}")
        return lines
