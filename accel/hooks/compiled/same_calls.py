"""The library's own ops, called twice with the same arguments in a compiled block, run once.

Inductor merges repeated work it generates itself (three per-row reductions of one tensor become
one kernel), but a custom op is an opaque call it neither fuses nor merges. Qwen-Image's attention
hands one modulated input to ``to_q``, ``to_k`` and ``to_v``; in float8 each quantizes it, three
identical calls of :func:`~accel.hooks.fp8.row_quant.quantize_rows_e4m3` (on an H100, 240 of a
1024x1024 step's 720, about 11 us each). :class:`SameCallsOnce` is an inductor post-grad pass that
keeps the first of calls with the same op and the same arguments and hands its result to the
others' users.

Only ops of the library's namespace (``bcg_diffusers``) whose schema mutates nothing are merged:
the library's ops are deterministic functions of their arguments, so a merged call computes the
very bits the removed one would have. Nothing else in the graph is touched.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["NAMESPACE", "SAME_CALLS_ONCE", "SameCallsOnce"]

NAMESPACE = "bcg_diffusers"

logger = logging.getLogger(__name__)


def _pure(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE:
        return False
    return not target._schema.is_mutable


# Nodes that only reshape a tensor or compute a size: each layer makes its own (every float8
# layer reshapes its input to rows), so two calls on one tensor see two such nodes. They are
# compared by what they compute, not by identity.
_STRUCTURAL = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.sym_size.int,
    operator.mul,
    operator.add,
    operator.floordiv,
}


def _key(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        if value.op == "call_function" and value.target in _STRUCTURAL:
            return ("computed", value.target, _key(value.args), _key(value.kwargs))
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_key, value))
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value  # numbers, dtypes, None: hashable


class SameCallsOnce(CustomGraphPass):
    """Merges repeated calls of the library's pure ops in an inductor graph (see the module)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        first: dict[Any, torch.fx.Node] = {}
        seen = merged = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or not _pure(node.target):
                continue
            try:
                key = (node.target, _key(node.args), _key(node.kwargs))
                hash(key)
            except TypeError:  # an argument that is not hashable: leave the call alone
                continue
            seen += 1
            earlier = first.setdefault(key, node)
            if earlier is not node:
                node.replace_all_uses_with(earlier)
                graph.erase_node(node)
                merged += 1
        logger.debug("%d of %d calls of the library's ops merged into earlier ones", merged, seen)

    def uuid(self) -> bytes:
        # Inductor's cache keys the compiled code by this: a change to the pass recompiles.
        return get_hash_for_files((__file__,))


# One instance: compile options made at different times compare equal.
SAME_CALLS_ONCE = SameCallsOnce()
