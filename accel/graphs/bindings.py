"""Where a Python function lives: what a callable wraps, which class defines a method a frame
runs, and every namespace that binds a function.

Locating a failed capture (:mod:`accel.graphs.sites`) and marking the function it failed in
(:mod:`accel.graphs.discover`) both ask these questions of plain Python objects; nothing here
knows of graphs. Namespaces are read through ``__dict__`` only, never ``getattr``: a lazy
module's attribute or a proxy must not run code while a capture failure is diagnosed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import CodeType, FrameType, FunctionType, MappingProxyType, MethodType, ModuleType
from typing import Any

import torch

__all__ = ["Resolved", "codes_of", "entry_codes", "find_bindings", "namespace", "owner_of", "unwrap"]


@dataclass(frozen=True)
class Resolved:
    """The function object a frame ran, and every ``(namespace, name, bound object)`` that holds it."""

    function: FunctionType
    bindings: tuple[tuple[Any, str, Any], ...]


def unwrap(obj: Any) -> Iterator[Any]:
    """``obj`` and what it wraps (staticmethod, classmethod, bound method, ``functools.wraps``)."""
    for _ in range(32):  # a bound against __wrapped__ cycles
        if obj is None or isinstance(obj, (type, ModuleType)):
            return
        yield obj
        if isinstance(obj, (staticmethod, classmethod, MethodType)):
            obj = obj.__func__
        else:  # read __dict__ only: a getattr could trigger a lazy module's import or a proxy
            d = getattr(obj, "__dict__", None)
            obj = d.get("__wrapped__") if isinstance(d, dict) else None


def namespace(obj: Any) -> Any:
    """``obj.__dict__`` (a module's or a class's), or an empty dict for anything odd in sys.modules."""
    d = getattr(obj, "__dict__", None)
    return d if isinstance(d, (dict, MappingProxyType)) else {}


def codes_of(obj: Any) -> list[CodeType]:
    """Code objects of the Python functions ``obj`` is or wraps (see :func:`unwrap`)."""
    return [f.__code__ for f in unwrap(obj) if isinstance(f, FunctionType)]


def entry_codes(fn: Callable[..., Any]) -> set[CodeType]:
    """Code objects of ``fn`` and of what it wraps (partials, ``__wrapped__``, a module's forward)."""
    codes = set(codes_of(fn))
    if isinstance(fn, functools.partial):
        codes |= entry_codes(fn.func)
    if isinstance(fn, torch.nn.Module):  # called through nn.Module.__call__, which is torch's
        codes |= set(codes_of(type(fn).forward))
    return codes


def _defining_class(start: type, code: CodeType) -> type | None:
    for klass in start.__mro__:
        if any(code in codes_of(raw) for raw in list(vars(klass).values())):
            return klass
    return None


def owner_of(frame: FrameType) -> type | None:
    """The class that defines the method ``frame`` runs, or None for a module-level function."""
    code = frame.f_code
    if code.co_argcount:
        first = frame.f_locals.get(code.co_varnames[0])
        for start in ((first,) if isinstance(first, type) else ()) + (type(first),):
            klass = _defining_class(start, code)
            if klass is not None:
                return klass
    # A staticmethod has no self: follow its qualified name from the module instead.
    qual = getattr(code, "co_qualname", "")
    if "." not in qual or "<locals>" in qual:
        return None
    obj: Any = sys.modules.get(frame.f_globals.get("__name__", ""))
    for part in qual.split(".")[:-1]:
        obj = namespace(obj).get(part)
    return _defining_class(obj, code) if isinstance(obj, type) else None


def find_bindings(code: CodeType, module: str | None, owner: type | None) -> Resolved | None:
    """The function that runs ``code`` and where it is bound: on ``owner`` (a method), or in
    ``module`` and every module that imported it from there; None when nothing binds it."""
    if owner is not None:
        bindings = [(owner, name, raw) for name, raw in list(vars(owner).items()) if code in codes_of(raw)]
    else:
        home = sys.modules.get(module or "")
        found = {id(v): v for v in list(namespace(home).values()) if code in codes_of(v)}
        bindings = [
            (mod, name, v)
            for mod in list(sys.modules.values())
            for name, v in list(namespace(mod).items())
            if id(v) in found and found[id(v)] is v
        ]
    if not bindings:
        return None
    fn = next(f for f in unwrap(bindings[0][2]) if isinstance(f, FunctionType) and f.__code__ is code)
    return Resolved(fn, tuple(bindings))
