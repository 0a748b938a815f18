"""What dynamo traces: a call compiled whole (``fullgraph``), run by a backend that keeps the traced
graph as it is, and the targets of the calls in that graph (an op that stays one opaque call,
a form that took another path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["traced"]


def traced(fn: Callable[..., Any], *args: Any, dynamic: bool | None = None, **kwargs: Any) -> tuple[Any, list[object]]:
    """``fn(*args, **kwargs)`` compiled by dynamo in one graph: its result and the call targets of
    the graphs traced (in order). Dynamo's caches are reset before and after."""
    seen: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return out, seen
