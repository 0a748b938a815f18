"""Qwen-Image 2.1's SwiGLU feed-forward handing its float8 down projection the product's factors
(accel/hooks/compiled/fused.py's fuse_swiglu_inputs as its recipe puts it in, accel/hooks/fp8/row_quant.py) on the CPU, where the
op is the modules' arithmetic: feed-forwards with the form give the unfused ones' bits with the
library's float8 layers (torch._scaled_mm runs on the CPU too); anything else takes diffusers'
path; dynamo traces the form in one graph; and a tiny pipeline under ``quantize="fp8",
compile=True`` with those layers runs the form in its graphs and equals itself without them."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.fp8.scaled_mm import Float8RowwiseLinear, ScaledMMFloat8
from pipelines.builders import build_pipeline, build_transformer
from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe, fuse_swiglu
from tests.helpers.cpu_compile import compile_on_cpu
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.float8_on_cpu import count_silu_mul
from tests.helpers.generate import generate
from tests.helpers.traced import traced

LAYERS = ("gate_layer", "proj", "out")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_silu_mul(monkeypatch)


def _model(quantized: tuple[str, ...] = LAYERS) -> tuple[torch.nn.Module, torch.Tensor]:
    t = build_transformer("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    names = [f"transformer_blocks.{i}.img_mlp.{name}" for i in range(2) for name in quantized]
    assert ScaledMMFloat8().quantize(t, names) == names
    x = torch.randn(2, 9, t.transformer_blocks[0].img_mlp.proj.in_features, generator=torch.Generator().manual_seed(1))
    return t, (x * 3).bfloat16()


@torch.no_grad()
def test_feed_forwards_with_the_form_give_the_unfused_bits_and_undo(counted: list[int]) -> None:
    t, x = _model()
    ffs = [b.img_mlp for b in t.transformer_blocks]
    want = [ff(x) for ff in ffs]
    assert not counted
    undo = fuse_swiglu(t)
    got = [ff(x) for ff in ffs]
    assert counted == [1, 1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # The product was never handed to the down projection's own forward.
    assert isinstance(ffs[0].out, Float8RowwiseLinear) and got[0].shape == x.shape
    undo()
    assert all("forward" not in vars(ff) for ff in ffs)
    ffs[0](x)
    assert counted == [1, 1]


@torch.no_grad()
@pytest.mark.parametrize("case", ["bf16 down projection", "measured through its forward", "recording gradients"])
def test_anything_else_takes_diffusers_path(counted: list[int], case: str) -> None:
    t, x = _model(("gate_layer", "proj") if case == "bf16 down projection" else LAYERS)
    ff = t.transformer_blocks[0].img_mlp
    want = ff(x)
    undo = fuse_swiglu(t)  # held: a patch nothing holds is undone
    assert "forward" in vars(ff)
    seen: list[torch.Tensor] = []
    if case == "measured through its forward":
        stock = ff.out.forward
        ff.out.forward = lambda h: seen.append(h) or stock(h)
    with torch.set_grad_enabled(case == "recording gradients"):
        got = ff(x)
    assert not counted and torch.equal(got, want)
    assert bool(seen) == (case == "measured through its forward")
    undo()


def test_dynamo_traces_the_form_in_one_graph_as_one_op(counted: list[int]) -> None:
    t, x = _model()
    undo = fuse_swiglu(t)
    ff = t.transformer_blocks[0].img_mlp
    try:
        with torch.no_grad():
            got, seen = traced(ff, x)
            assert torch.equal(got, ff(x))
    finally:
        undo()
    assert torch.ops.bcg_diffusers.quantize_silu_mul_rows_e4m3.default in seen
    assert torch.nn.functional.silu not in seen and torch.ops.bcg_diffusers.quantize_rows_e4m3.default in seen


@torch.no_grad()
def test_the_recipe_puts_the_form_in_with_its_compiled_forms_and_takes_it_out(counted: list[int]) -> None:
    t, x = _model()
    ff = t.transformer_blocks[0].img_mlp
    want = ff(x)
    undo = QwenImage21Recipe().compiled_forms(t)
    assert all("forward" in vars(b.img_mlp) for b in t.transformer_blocks)
    assert torch.equal(ff(x), want) and counted == [1]
    undo()
    assert all("forward" not in vars(b.img_mlp) for b in t.transformer_blocks)


@torch.no_grad()
def test_a_compiled_float8_pipeline_runs_the_form_in_its_graphs_and_equals_itself_without_them(
    counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny Qwen-Image 2.1 with the library's float8 layers (as ``--fp8-backend scaled-mm`` runs
    it), ``compile=True`` on the CPU under emulated graphs."""
    emulate_pipelines(monkeypatch)
    compile_on_cpu(monkeypatch)
    monkeypatch.setattr(QwenImage21Recipe, "fp8_layers", "scaled-mm")
    pipe = build_pipeline("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    bf16 = generate(pipe, "a lighthouse in a storm", steps=3)
    try:
        accelerate_pipeline(pipe, quantize="fp8", fp8_budget=1.0, compile=True)
        pipe.accel.warmup((64, 64), prompts=["a lighthouse in a storm"], progress=False)
        ffs = [b.img_mlp for b in pipe.transformer.transformer_blocks]
        assert all(isinstance(ff.out, Float8RowwiseLinear) and "forward" in vars(ff) for ff in ffs)
        runner = pipe.accel.runners["transformer"]
        replays, calls = runner.counts.replays, len(counted)
        graphed = generate(pipe, "a lighthouse in a storm", steps=3)
        assert runner.counts.replays > replays and len(counted) > calls
        runner.enabled = False
        assert torch.equal(graphed, generate(pipe, "a lighthouse in a storm", steps=3))
        runner.enabled = True
        assert 0 < ((graphed.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.2
        pipe.accel.restore()
        assert all("forward" not in vars(ff) for ff in ffs)
    finally:
        torch._dynamo.reset()
