"""Find the operation that broke a CUDA-graph capture, and mark its enclosing function as an eager break.

A capture fails when the captured code synchronises with the host (``.item()``, ``.tolist()``, a tensor in
a Python ``if``, ``nonzero``, a data-dependent index such as ``x[mask]``): CUDA raises (``operation not
permitted when stream is capturing``, ``cudaErrorStreamCapture*``) and the traceback runs through the
model's frames down to the offending line.

Contract:

* :func:`locate` names the *enclosing function*: the innermost traceback frame outside torch, ``accel``
  and the standard library. When the error has no such frame (some failures surface only when the capture
  ends), :func:`locate_by_sync_debug` re-runs the call eagerly with host syncs made errors.
  :func:`discover` tries both, in that order, and only for capture errors.
* :func:`mark_as_break` rebinds that function, wherever it is bound (its module, every module that did
  ``from x import f``, or the class defining the method), to :func:`accel.graphs.bcg.eager_on_graph` of it,
  through :mod:`accel.graphs.patches`, and returns an undo. A :class:`BreakSite` keeps the code object and
  where to look, never the frame, so locating and marking are separate steps.
* Only a pure function of its inputs may be marked. A break re-runs at every replay with the *same
  argument objects* and its tensor outputs are copied into the boundary buffer later segments read; the
  Python constants it returns (a bool, a list of lengths) are checked by copy-back, so a changed value
  raises :class:`accel.graphs.bcg.CopyBackError` rather than silently replaying the branch taken at capture.
  Anything it reads besides its arguments (globals, counters) makes replays wrong.
* Marking is opt-in, and whoever marks must check that the retried graph's output equals eager.

This module knows Python frames and torch, nothing of diffusers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import linecache
import logging
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType, MappingProxyType, MethodType, ModuleType
from typing import Any

import torch

from . import bcg
from .patches import Patch, patch

__all__ = [
    "DEFAULT_SKIP",
    "BreakSite",
    "Resolved",
    "discover",
    "entry_codes",
    "is_capture_error",
    "locate",
    "locate_by_sync_debug",
    "mark_as_break",
    "mark_by_name",
    "resolve",
]

logger = logging.getLogger(__name__)

#: Top-level packages whose frames are never the enclosing function (the stdlib is always skipped).
DEFAULT_SKIP: tuple[str, ...] = ("torch", __name__.split(".")[0])

_CAPTURE_MESSAGES = re.compile(
    r"operation not permitted when stream is capturing|cudaerrorstreamcapture|capturing"
    r"|capture.*invalidated|invalidated.*capture|during (cuda graph )?capture"
    r"|called a synchronizing cuda operation"
)
_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@dataclass(frozen=True)
class BreakSite:
    """Where a capture broke: the enclosing function and the line inside it."""

    function: str  # module-qualified, e.g. "pkg.mod.Class.method"
    filename: str
    lineno: int
    line: str
    error: str  # "Type: first line of the message"
    _code: CodeType | None = field(default=None, compare=False, repr=False)
    _module: str | None = field(default=None, compare=False, repr=False)
    _owner: type | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        short = self.function.removeprefix(f"{self._module}.") if self._module else self.function
        return f"{short} ({_short_path(self.filename)}:{self.lineno}: `{self.line}`): {self.error}"


@dataclass(frozen=True)
class Resolved:
    """The function object a frame ran, and every ``(namespace, name, bound object)`` that holds it."""

    function: FunctionType
    bindings: tuple[tuple[Any, str, Any], ...]


def _short_path(path: str) -> str:
    norm = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in norm:
            return norm.rsplit(marker, 1)[1]
    return "/".join(norm.split("/")[-3:])


def _one_line(exc: BaseException) -> str:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and everything it was raised from or during, outermost first."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is not None and not any(e is seen for seen in out):
            out.append(e)
            todo += [e.__cause__, e.__context__]
    return out


def _is_capture_message(exc: BaseException) -> bool:
    return _CAPTURE_MESSAGES.search(str(exc).lower()) is not None


def is_capture_error(exc: BaseException) -> bool:
    """True when ``exc``, or an error it was raised from or during, reports a failed CUDA-graph capture."""
    return any(_is_capture_message(e) for e in _chain(exc))


def _unwrap(obj: Any) -> Iterator[Any]:
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


def _namespace(obj: Any) -> Any:
    """``obj.__dict__`` (a module's or a class's), or an empty dict for anything odd in sys.modules."""
    d = getattr(obj, "__dict__", None)
    return d if isinstance(d, (dict, MappingProxyType)) else {}


def _codes(obj: Any) -> list[CodeType]:
    return [f.__code__ for f in _unwrap(obj) if isinstance(f, FunctionType)]


def entry_codes(fn: Callable[..., Any]) -> set[CodeType]:
    """Code objects of ``fn`` and of what it wraps (partials, ``__wrapped__``, a module's forward)."""
    codes = set(_codes(fn))
    if isinstance(fn, functools.partial):
        codes |= entry_codes(fn.func)
    if isinstance(fn, torch.nn.Module):  # called through nn.Module.__call__, which is torch's
        codes |= set(_codes(type(fn).forward))
    return codes


def _defining_class(start: type, code: CodeType) -> type | None:
    for klass in start.__mro__:
        if any(code in _codes(raw) for raw in list(vars(klass).values())):
            return klass
    return None


def _owner(frame: FrameType) -> type | None:
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
        obj = _namespace(obj).get(part)
    return _defining_class(obj, code) if isinstance(obj, type) else None


def _skipped(frame: FrameType, skip: Iterable[str]) -> bool:
    module = frame.f_globals.get("__name__") or ""
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or any(module == s or module.startswith(s + ".") for s in skip)


def _site(frame: FrameType, lineno: int, exc: BaseException) -> BreakSite:
    code = frame.f_code
    module = frame.f_globals.get("__name__") or "?"
    owner = _owner(frame)
    qual = getattr(code, "co_qualname", None) or (f"{owner.__qualname__}.{code.co_name}" if owner else code.co_name)
    line = linecache.getline(code.co_filename, lineno, frame.f_globals).strip()
    return BreakSite(f"{module}.{qual}", code.co_filename, lineno, line, _one_line(exc), code, module, owner)


def locate(
    exc: BaseException, *, skip: Iterable[str] = DEFAULT_SKIP, within: Callable[..., Any] | None = None
) -> BreakSite | None:
    """The innermost frame of ``exc``'s traceback (or its causes') outside ``skip`` and the stdlib.

    ``within``: only frames from ``within``'s own frame inwards count, so the frame that caught
    an error raised at the end of a capture is not mistaken for model code.
    """
    skip = tuple(skip)
    entry = entry_codes(within) if within is not None else None
    chain = _chain(exc)
    # The original error has the deepest traceback; capture errors before unrelated ones.
    for e in sorted(reversed(chain), key=lambda e: not _is_capture_message(e)):
        frames = list(traceback.walk_tb(e.__traceback__))
        if entry is not None:
            start = next((i for i, (f, _) in enumerate(frames) if f.f_code in entry), None)
            if start is None and e is exc:
                continue  # raised outside the call (e.g. when the capture ended)
            frames = frames[start or 0 :]
        for frame, lineno in reversed(frames):
            if not _skipped(frame, skip):
                return _site(frame, lineno, e)
    return None


def locate_by_sync_debug(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, skip: Iterable[str] = DEFAULT_SKIP
) -> BreakSite | None:
    """Re-run ``fn`` eagerly with host syncs made errors and locate the first; None without CUDA.

    The call runs for real (under no_grad): anything it mutates is mutated once more.
    """
    if not torch.cuda.is_available():
        return None
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with torch.no_grad():
            torch.cuda.set_sync_debug_mode("error")
            fn(*args, **kwargs)
    except Exception as err:
        site = locate(err, skip=skip) if is_capture_error(err) else None
        traceback.clear_frames(err.__traceback__)  # free the aborted call's activations now
        return site
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def resolve(target: BreakSite | FrameType) -> Resolved | None:
    """The function a site (or frame) ran and where it is bound; None when nothing binds it."""
    if isinstance(target, BreakSite):
        code, module, owner = target._code, target._module, target._owner
    else:
        code, module, owner = target.f_code, target.f_globals.get("__name__"), _owner(target)
    if code is None:
        return None
    if owner is not None:
        bindings = [(owner, name, raw) for name, raw in list(vars(owner).items()) if code in _codes(raw)]
    else:
        home = sys.modules.get(module or "")
        found = {id(v): v for v in list(_namespace(home).values()) if code in _codes(v)}
        bindings = [
            (mod, name, v)
            for mod in list(sys.modules.values())
            for name, v in list(_namespace(mod).items())
            if id(v) in found and found[id(v)] is v
        ]
    if not bindings:
        return None
    fn = next(f for f in _unwrap(bindings[0][2]) if isinstance(f, FunctionType) and f.__code__ is code)
    return Resolved(fn, tuple(bindings))


def _marked(raw: Any, name: str) -> Any:
    # Keyed: a found function often computes data-dependent shapes (valid lengths from a mask);
    # each output structure then gets a chain of its own instead of the call running eagerly.
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw)(bcg.eager_on_graph(raw.__func__, name=name, keyed=True))
    return bcg.eager_on_graph(raw, name=name, keyed=True)


def mark_as_break(site: BreakSite, *, refuse: Iterable[CodeType] = ()) -> Callable[[], None]:
    """Make every binding of ``site``'s function an eager break; returns an idempotent undo.

    ``refuse``: code objects that must not become breaks (the top-level forward: a break there
    would leave nothing to capture). Raises ValueError when refused or unresolvable.
    """
    res = resolve(site)
    if res is None:
        raise ValueError(f"cannot mark {site.function}: no module or class binds it (a closure or a lambda?)")
    codes = {c for _, _, raw in res.bindings for c in _codes(raw)}
    if codes & set(refuse):
        raise ValueError(f"refusing to mark {site.function}: it is the top-level call, a break would leave no graph")
    if any(getattr(f, "__bcg_eager__", False) for _, _, raw in res.bindings for f in _unwrap(raw)):
        raise ValueError(f"{site.function} is already marked as an eager break")
    if any(c.co_flags & _NOT_PLAIN for c in codes):
        raise ValueError(f"cannot mark {site.function}: a generator or coroutine cannot run as a break")
    done: list[tuple[Any, str, Patch]] = []

    def undo() -> None:
        while done:  # emptied as it goes: a second call finds nothing left to put back
            done.pop()[2].undo()

    made: dict[int, Any] = {}
    try:
        for ns, name, raw in res.bindings:
            if id(raw) not in made:  # one wrapper per object, so copies of it stay identical
                made[id(raw)] = _marked(raw, site.function)
            done.append((ns, name, patch(ns, name, made[id(raw)], why=f"an eager break ({site.function})")))
    except (AttributeError, TypeError) as e:  # a read-only namespace: leave nothing half marked
        undo()
        raise ValueError(f"cannot mark {site.function}: {e}") from e
    where = ", ".join(f"{getattr(ns, '__name__', ns)}.{name}" for ns, name, _ in done)
    logger.info("marked %s as an eager break (bound at %s)", site.function, where)
    return undo


# Breaks known in advance are shared: several pipelines (or their text encoders) may name the same
# function, and the mark must stay until the last of them lets go.
_named: dict[str, list[Any]] = {}  # qualname -> [users, undo]


def mark_by_name(qualname: str, *, refuse: Iterable[CodeType] = ()) -> Callable[[], None]:
    """:func:`mark_as_break` for a break known in advance, named ``module.qualname`` (a recipe's list).

    E.g. ``transformers.masking_utils._ignore_causal_mask_sdpa`` or ``pkg.mod.Class.method`` (the
    class that defines the method). Raises ValueError as :func:`mark_as_break` does, or when the
    name does not lead to a Python function (another library version may have moved it). Marks by
    name are counted: the function is given back when every returned undo has been called.
    """
    entry = _named.get(qualname)
    if entry is None:
        entry = _named[qualname] = [0, _mark_named(qualname, refuse)]
    entry[0] += 1
    return _NamedUse(qualname, entry)


class _NamedUse:
    """One user's hold on a mark by name: calling it lets go (once); so does its collection, so
    a user dropped without letting go (a pipeline never restored) does not keep the mark."""

    __slots__ = ("_entry", "_qualname")

    def __init__(self, qualname: str, entry: list[Any]) -> None:
        self._qualname: str | None = qualname
        self._entry = entry

    def __call__(self) -> None:
        qualname, self._qualname = self._qualname, None
        if qualname is None:
            return
        entry = self._entry
        entry[0] -= 1
        if entry[0] == 0 and _named.get(qualname) is entry:
            del _named[qualname]
            entry[1]()

    def __del__(self) -> None:
        try:
            self()
        except Exception:  # interpreter shutdown
            pass


def _mark_named(qualname: str, refuse: Iterable[CodeType]) -> Callable[[], None]:
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            continue
        owner: Any = None
        for part in parts[i:]:
            owner, obj = obj, _namespace(obj).get(part)
        codes = _codes(obj)
        if not codes:
            raise ValueError(f"cannot mark {qualname}: {module} has no Python function of that name")
        code = codes[-1]
        line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
        owner = owner if isinstance(owner, type) else None
        site = BreakSite(qualname, code.co_filename, code.co_firstlineno, line, "named", code, module, owner)
        return mark_as_break(site, refuse=refuse)
    raise ValueError(f"cannot mark {qualname}: no module of that name can be imported")


def discover(
    exc: BaseException, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> BreakSite | None:
    """For the runner: the site behind a failed capture of ``fn(*args, **kwargs)``, or None.

    Only capture errors are looked at (an out-of-memory or a shape bug names no break).
    """
    if not is_capture_error(exc):
        return None
    site = locate(exc, within=fn)
    if site is not None and resolve(site) is not None:
        return site
    if site is not None:
        logger.info("capture broke in %s, which cannot be marked; re-running under sync debug", site)
    return locate_by_sync_debug(fn, args, kwargs)
