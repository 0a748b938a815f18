"""accel.compile on the CPU: what it tells torch's caches (the compiling itself needs CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

from accel.compile import AUTOCAST_FUNCTIONS, cache_autocast_regions


def _autocast_nodes() -> list[Any]:
    """The autocast nodes of the graph dynamo makes for a function with an autocast-off region
    (as in Z-Image's rotary embedding)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            y = x.float() * 2
        return y.to(x.dtype) + 1

    torch._dynamo.reset()
    try:
        torch.compile(f, backend=backend, fullgraph=True)(torch.randn(4, dtype=torch.bfloat16))
    finally:
        torch._dynamo.reset()
    return [n for g in graphs for n in g.graph.nodes if getattr(n.target, "__name__", "") in AUTOCAST_FUNCTIONS]


def test_autocast_regions_become_cacheable_for_aotautograd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inductor_config, "unsafe_marked_cacheable_functions", {})
    nodes = _autocast_nodes()
    assert {n.target.__name__ for n in nodes} == set(AUTOCAST_FUNCTIONS)
    for node in nodes:  # refused as it comes: every warm start would redo AOTAutograd
        with pytest.raises(BypassAOTAutogradCache, match="autocast"):
            check_node_safe(node)
    marked = cache_autocast_regions()
    assert marked == [f"torch.amp.autocast_mode.{n}" for n in AUTOCAST_FUNCTIONS]
    assert all(inductor_config.unsafe_marked_cacheable_functions[m] == torch.__version__ for m in marked)
    for node in nodes:
        check_node_safe(node)  # no longer refused
