"""Where a CUDA-graph capture broke: the operation's line and the function around it.

A capture fails when the captured code synchronises with the host (``.item()``, ``.tolist()``, a tensor in
a Python ``if``, ``nonzero``, a data-dependent index such as ``x[mask]``): CUDA raises (``operation not
permitted when stream is capturing``, ``cudaErrorStreamCapture*``) and the traceback runs through the
model's frames down to the offending line.

:func:`locate` names the *enclosing function*: the innermost traceback frame outside torch, ``accel``
and the standard library. When the error has no such frame (some failures surface only when the capture
ends), :func:`locate_by_sync_debug` re-runs the call eagerly with host syncs made errors. A
:class:`BreakSite` keeps the code object and where to look, never the frame, so locating and marking
(:mod:`accel.graphs.discover`) are separate steps; :func:`resolve` finds the function it names.

This module knows Python frames and torch, nothing of diffusers.
"""

from __future__ import annotations

import linecache
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

from .bindings import Resolved, entry_codes, find_bindings, owner_of

__all__ = ["DEFAULT_SKIP", "BreakSite", "is_capture_error", "locate", "locate_by_sync_debug", "resolve"]

#: Top-level packages whose frames are never the enclosing function (the stdlib is always skipped).
DEFAULT_SKIP: tuple[str, ...] = ("torch", __name__.split(".")[0])

_CAPTURE_MESSAGES = re.compile(
    r"operation not permitted when stream is capturing|cudaerrorstreamcapture|capturing"
    r"|capture.*invalidated|invalidated.*capture|during (cuda graph )?capture"
    r"|called a synchronizing cuda operation"
)


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


def _skipped(frame: FrameType, skip: Iterable[str]) -> bool:
    module = frame.f_globals.get("__name__") or ""
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or any(module == s or module.startswith(s + ".") for s in skip)


def _site(frame: FrameType, lineno: int, exc: BaseException) -> BreakSite:
    code = frame.f_code
    module = frame.f_globals.get("__name__") or "?"
    owner = owner_of(frame)
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
        code, module, owner = target.f_code, target.f_globals.get("__name__"), owner_of(target)
    if code is None:
        return None
    return find_bindings(code, module, owner)
