"""Find the operation that broke a CUDA-graph capture, and mark its enclosing function as an eager break.

Contract:

* :func:`discover` names the site behind a failed capture, and only for capture errors: the
  innermost frame of the traceback outside torch, ``accel`` and the standard library
  (:func:`~accel.graphs.sites.locate`), or, when that names nothing that can be marked, the
  first host sync of an eager re-run (:func:`~accel.graphs.sites.locate_by_sync_debug`).
* :func:`mark_as_break` rebinds that function, wherever it is bound (its module, every module that did
  ``from x import f``, or the class defining the method), to :func:`accel.graphs.bcg.eager_on_graph` of it,
  through :mod:`accel.graphs.patches`, and returns an undo. :func:`mark_by_name` does the same for a
  break known in advance, counted per user.
* Only a pure function of its inputs may be marked. A break re-runs at every replay with the *same
  argument objects* and its tensor outputs are copied into the boundary buffer later segments read; the
  Python constants it returns (a bool, a list of lengths) are checked by copy-back, so a changed value
  raises :class:`accel.graphs.bcg.CopyBackError` rather than silently replaying the branch taken at capture.
  Anything it reads besides its arguments (globals, counters) makes replays wrong.
* Marking is opt-in, and whoever marks must check that the retried graph's output equals eager.

:class:`~accel.graphs.sites.BreakSite` is this module's currency (what :func:`discover` returns
and :func:`mark_as_break` takes), so it is named here too. This module knows Python frames and
torch, nothing of diffusers.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import logging
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any

from . import bcg
from .bindings import codes_of, namespace, unwrap
from .patches import Patch, patch
from .sites import BreakSite, is_capture_error, locate, locate_by_sync_debug, resolve

__all__ = ["BreakSite", "discover", "mark_as_break", "mark_by_name"]

logger = logging.getLogger(__name__)

_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


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
    codes = {c for _, _, raw in res.bindings for c in codes_of(raw)}
    if codes & set(refuse):
        raise ValueError(f"refusing to mark {site.function}: it is the top-level call, a break would leave no graph")
    if any(getattr(f, "__bcg_eager__", False) for _, _, raw in res.bindings for f in unwrap(raw)):
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
            owner, obj = obj, namespace(obj).get(part)
        codes = codes_of(obj)
        if not codes:
            raise ValueError(f"cannot mark {qualname}: {module} has no Python function of that name")
        code = codes[-1]
        line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
        owner = owner if isinstance(owner, type) else None
        site = BreakSite(qualname, code.co_filename, code.co_firstlineno, line, "named", code, module, owner)
        return mark_as_break(site, refuse=refuse)
    raise ValueError(f"cannot mark {qualname}: no module of that name can be imported")
