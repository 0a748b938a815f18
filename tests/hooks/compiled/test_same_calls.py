"""accel.hooks.compiled.same_calls on the CPU: repeated calls of the library's pure ops merged in
an inductor graph, nothing else touched; and through inductor itself."""

from __future__ import annotations

import torch

from accel.hooks.compiled.compile import PASS_SETTING, compile_options
from accel.hooks.compiled.same_calls import SAME_CALLS_ONCE, SameCallsOnce

CALLS: list[int] = []


@torch.library.custom_op("bcg_diffusers::test_counted_rows", mutates_args=())
def counted_rows(x: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS.append(1)
    return x * 2 + flag, x.amax(dim=-1, keepdim=True)


@counted_rows.register_fake
def _(x: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))


@torch.library.custom_op("bcg_diffusers::test_fill_", mutates_args=("out",))
def fill_(out: torch.Tensor, value: float) -> None:
    out.fill_(value)


def _three_projections(x: torch.Tensor) -> torch.Tensor:
    q = counted_rows(x, True)  # the same input three times (to_q, to_k, to_v), once with another flag
    k = counted_rows(x, True)
    v = counted_rows(x, False)
    w = torch.sin(x) + torch.sin(x)  # aten ops are inductor's business, not the pass's
    return q[0] + k[0] * k[1] + v[0] + w


def test_the_pass_merges_repeated_pure_calls_of_the_library_only() -> None:
    gm = torch.fx.symbolic_trace(_three_projections)
    mutating = gm.graph.call_function(torch.ops.bcg_diffusers.test_fill_.default, (next(iter(gm.graph.nodes)), 1.0))
    gm.graph.call_function(torch.ops.bcg_diffusers.test_fill_.default, (next(iter(gm.graph.nodes)), 1.0))
    del mutating
    ops = lambda: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    before = ops()
    # symbolic_trace records the Python-level op; the pass sees ATen overloads (post-grad graphs)
    for node in gm.graph.nodes:
        if node.target is counted_rows:
            node.target = torch.ops.bcg_diffusers.test_counted_rows.default
    SameCallsOnce()(gm.graph)
    after = ops()
    others = lambda names: [n for n in names if "bcg_diffusers" not in n]  # noqa: E731
    assert others(after) == others(before) and len(others(before)) >= 4  # two sins, their sum, the rest
    assert after.count("bcg_diffusers.test_counted_rows.default") == 2  # (x, True) once, (x, False) once
    assert after.count("bcg_diffusers.test_fill_.default") == 2  # mutating: never merged
    gm.graph.lint()


def test_inductor_runs_the_merged_graph_with_the_same_result() -> None:
    x = torch.randn(4, 8)
    want = _three_projections(x)
    options = compile_options()
    assert options["options"][PASS_SETTING] is SAME_CALLS_ONCE
    torch._dynamo.reset()
    try:
        compiled = torch.compile(_three_projections, **options)
        compiled(x)  # compiles
        CALLS.clear()
        got = compiled(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)  # inductor rounds its own fused sums its way
    assert len(CALLS) == 2, "the two identical calls should run once"
    assert SAME_CALLS_ONCE.uuid() == SameCallsOnce().uuid()


@torch.no_grad()
def test_three_float8_layers_on_one_input_quantize_it_once_under_inductor(monkeypatch) -> None:
    from accel.hooks.fp8 import row_quant
    from accel.hooks.fp8.scaled_mm import ScaledMMFloat8

    torch.manual_seed(0)
    attn = torch.nn.ModuleDict({n: torch.nn.Linear(64, 32, dtype=torch.bfloat16) for n in ("to_q", "to_k", "to_v")})
    ScaledMMFloat8().quantize(attn, ["to_q", "to_k", "to_v"])

    def project(x: torch.Tensor) -> torch.Tensor:  # what an attention processor does
        return attn["to_q"](x) + attn["to_k"](x) * attn["to_v"](x)

    counted: list[int] = []
    reference = row_quant.quantize_rows_reference
    monkeypatch.setattr(row_quant, "quantize_rows_reference", lambda *a: counted.append(1) or reference(*a))
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    want = project(x)
    assert len(counted) == 3
    options = compile_options()  # dynamic shapes, as the blocks compile
    without = {**options, "options": {k: v for k, v in options["options"].items() if k != PASS_SETTING}}
    torch._dynamo.reset()
    try:
        compiled = torch.compile(project, **options)
        unmerged = torch.compile(lambda t: project(t) + 0, **without)
        for shape in [(2, 7, 64), (3, 5, 64)]:
            y = torch.randn(*shape, dtype=torch.bfloat16)
            compiled(y)
            counted.clear()
            got = compiled(y)
            assert len(counted) == 1, f"{shape}: the input was quantized {len(counted)} times"
            counted.clear()
            assert torch.equal(got, unmerged(y)) and len(counted) == 3  # the same bits, three calls without it
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(want, project(x))
