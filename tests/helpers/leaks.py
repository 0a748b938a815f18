"""Who keeps an object alive: the path from a module's globals to it, for assertion messages."""

from __future__ import annotations

import collections
import gc
import sys
import types
from typing import Any


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"dict{list(obj)[:4]!r}"
    return f"{type(obj).__name__}: {repr(obj)[:70]}"


def holder_path(obj: Any, max_depth: int = 16) -> str:
    """The shortest chain of referrers from a module's namespace to ``obj`` (frames skipped:
    a test's own locals are not a leak), one line per link; or a note that none was found."""
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None and hasattr(m, "__dict__")}
    came_from: dict[int, int | None] = {id(obj): None}
    held: dict[int, Any] = {id(obj): obj}
    queue = collections.deque([(obj, 0)])
    own = {id(came_from), id(held), id(queue)}
    while queue:
        cur, depth = queue.popleft()
        if depth >= max_depth:
            continue
        for ref in gc.get_referrers(cur):
            if id(ref) in came_from or id(ref) in own or isinstance(ref, types.FrameType):
                continue
            came_from[id(ref)] = id(cur)
            held[id(ref)] = ref
            if id(ref) in modules:
                path, at = [f"module {modules[id(ref)]}"], id(cur)
                while at is not None:
                    path.append(_describe(held[at]))
                    at = came_from[at]
                return "\n  -> ".join(path)
            queue.append((ref, depth + 1))
    return "no module holds it (a frame or a cycle the collector has not reached)"
