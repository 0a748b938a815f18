"""Qwen-Image 2.1's modulated norms writing their float8 consumers' input
(pipelines/families/qwen_image_21/fused_norms.py, accel/hooks/fp8/norm_quant.py) on the CPU, where
the op is the modules' arithmetic: the transformer with the form gives the unfused transformer's
bits with the library's float8 layers (torch._scaled_mm runs on the CPU too), text and condition
tokens taking the t = 0 modulation row; a norm whose consumers are anything else takes diffusers'
path; dynamo traces a block with the form in one graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accel
from accel.hooks.fp8 import norm_quant, scaled_mm
from accel.hooks.fp8.scaled_mm import ScaledMMFloat8
from pipelines.builders import build_transformer
from pipelines.families.qwen_image_21.fused_norms import Modulated, Normed, fuse_norm_quantization
from pipelines.families.qwen_image_21.layout import LayoutMemo, layout_forward
from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe, fuse_swiglu
from tests.pipelines.families.test_qwen_image_21 import _forward_inputs, traced_first_block

ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
FEED_FORWARD = ("img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The fused op's calls: whether a token's modulation row was named, per call."""
    seen: list[Any] = []
    op = norm_quant.modulated_norm_rows_e4m3
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: seen.append(a[4] is not None) or op(*a))
    monkeypatch.setattr(scaled_mm, "check_fp8_device", lambda device, what="": None)
    return seen


def _model(layers: tuple[str, ...] = ATTENTION + FEED_FORWARD) -> tuple[torch.nn.Module, Any]:
    """The tiny transformer in bf16, ``layers`` of each block the library's float8 layers, and its
    forward with the layout factored out (the recipe's: the stock one syncs with the host)."""
    t = build_transformer("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    names = [f"transformer_blocks.{i}.{name}" for i in range(len(t.transformer_blocks)) for name in layers]
    assert ScaledMMFloat8().quantize(t, names) == names
    return t, layout_forward(t.forward, LayoutMemo())


def _inputs(seed: int = 0, **kw: Any) -> dict[str, Any]:
    inputs = _forward_inputs(torch.Generator().manual_seed(seed), **kw)
    return {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@torch.no_grad()
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_transformer_with_the_form_gives_the_unfused_bits(calls: list[Any], condition: bool) -> None:
    t, forward = _model()
    inputs = _inputs(condition=condition, padded=True)
    undo_ffn = fuse_swiglu(t)  # as the recipe puts both in; held, or undone at once
    want = forward(**inputs)[0]
    assert not calls
    undo = fuse_norm_quantization(t)
    got = forward(**inputs)[0]
    # Per block: to_q, to_k, to_v and gate_layer, proj each ask for the rows (a compiled block runs
    # identical calls once); text and condition tokens take the last modulation row: rows named.
    assert len(calls) == 5 * len(t.transformer_blocks) and all(calls)
    assert torch.equal(got, want)
    undo()
    undo_ffn()
    block = t.transformer_blocks[0]
    assert "_modulate" not in vars(block) and "forward" not in vars(block.img_norm1)


@torch.no_grad()
def test_with_contiguous_scales_the_op_gets_contiguous_rows_and_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    op = norm_quant.modulated_norm_rows_e4m3
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: seen.append(a[2].is_contiguous()) or op(*a))
    monkeypatch.setattr(scaled_mm, "check_fp8_device", lambda device, what="": None)
    t, forward = _model()
    inputs = _inputs(condition=True, padded=True)  # two modulation rows: the scale a strided slice
    undo_ffn = fuse_swiglu(t)
    got = []
    for contiguous in (False, True):
        undo = fuse_norm_quantization(t, contiguous_scales=contiguous)
        got.append(forward(**inputs)[0])
        undo()
    undo_ffn()
    n = 5 * len(t.transformer_blocks)
    assert seen == [False] * n + [True] * n
    assert torch.equal(got[0], got[1])


@torch.no_grad()
@pytest.mark.parametrize(
    "case", ["bf16 attention projections", "bf16 feed-forward", "measured through its forward", "another processor"]
)
def test_a_norm_whose_consumers_are_anything_else_takes_diffusers_path(calls: list[Any], case: str) -> None:
    layers = {"bf16 attention projections": FEED_FORWARD, "bf16 feed-forward": ATTENTION}.get(case)
    t, forward = _model(layers or ATTENTION + FEED_FORWARD)
    block = t.transformer_blocks[0]
    if case == "measured through its forward":
        stock = block.attn.to_k.forward
        block.attn.to_k.forward = lambda h: stock(h)
    if case == "another processor":

        class Processor(type(block.attn.processor)):
            pass

        block.attn.set_processor(Processor())
    inputs = _inputs(condition=True, padded=False)
    want = forward(**inputs)[0]
    undo = fuse_norm_quantization(t)
    assert torch.equal(forward(**inputs)[0], want)
    blocks = len(t.transformer_blocks)
    expected = {
        "bf16 attention projections": 2 * blocks,  # the feed-forwards' only
        "bf16 feed-forward": 3 * blocks,  # the attentions' only
        "measured through its forward": 5 * blocks - 3,  # the first block's attention takes diffusers' path
        "another processor": 5 * blocks - 3,
    }[case]
    assert len(calls) == expected
    undo()


@torch.no_grad()
def test_modulate_without_a_pending_norm_or_with_a_modulation_it_cannot_read_is_diffusers(calls: list[Any]) -> None:
    t, _ = _model()
    undo = fuse_norm_quantization(t)
    block = t.transformer_blocks[0]
    x = torch.randn(2, 5, t.inner_dim).bfloat16()
    mod = torch.randn(3, 2 * t.inner_dim).bfloat16()
    mask = torch.tensor([False, True, True, True, True])
    pending = block.img_norm1(x)
    stock = type(block)._modulate(block, pending.tensor(), mod, mask)
    assert isinstance(pending, Normed)
    modulated, gate = block._modulate(pending, mod, mask)
    assert isinstance(modulated, Modulated) and torch.equal(gate.tanh(), stock[1].tanh())
    assert modulated.rows.tolist() == [2, 0, 0, 0, 0, 2, 1, 1, 1, 1]
    # A modulation of another row count than the batch (and the mask's t = 0 row) is normalised here.
    out, _ = block._modulate(pending, mod[:1], None)
    want, _ = type(block)._modulate(block, pending.tensor(), mod[:1], None)
    assert isinstance(out, torch.Tensor) and torch.equal(out, want)
    out, gate = block._modulate(x, mod, mask)
    want, want_gate = type(block)._modulate(block, x, mod, mask)
    assert torch.equal(out, want) and torch.equal(gate.tanh(), want_gate.tanh())
    undo()


class _TanhShapes(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tanh, torch.tanh):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_gates_tanh_is_taken_on_their_rows_with_diffusers_bits(calls: list[Any], condition: bool) -> None:
    # bf16 layers throughout: only the gate's form acts.
    t, forward = _model(layers=())
    inputs = _inputs(seed=3, condition=condition, padded=True)
    want = forward(**inputs)[0]
    with _TanhShapes() as stock:
        forward(**inputs)
    undo = fuse_norm_quantization(t)
    try:
        with _TanhShapes() as formed:
            got = forward(**inputs)[0]
    finally:
        undo()
    assert torch.equal(got, want) and not calls
    blocks = len(t.transformer_blocks)
    tokens = inputs["hidden_states"].shape[1]
    assert len(stock.shapes) == len(formed.shapes) == 2 * blocks
    assert all(s[1] >= tokens for s in stock.shapes)  # diffusers': one per token and channel
    assert all(len(s) == 2 and s[0] <= inputs["hidden_states"].shape[0] + 1 for s in formed.shapes)


def test_dynamo_traces_a_block_with_the_form_in_one_graph(calls: list[Any]) -> None:
    t, forward = _model()
    forms = [lambda: fuse_swiglu(t), lambda: fuse_norm_quantization(t)]
    eager, compiled, seen = traced_first_block(t, forward, _inputs(condition=True, padded=True), forms)
    assert torch.equal(eager, compiled)
    assert torch.ops.bcg_diffusers.modulated_norm_rows_e4m3.default in seen
    assert torch.ops.bcg_diffusers.quantize_silu_mul_rows_e4m3.default in seen
    assert torch.nn.functional.layer_norm not in seen and torch.ops.bcg_diffusers.quantize_rows_e4m3.default in seen


def test_a_block_whose_class_forward_is_not_diffusers_own_keeps_its_modulate(monkeypatch: pytest.MonkeyPatch) -> None:
    t, _ = _model(layers=())
    block = t.transformer_blocks[0]
    stock = type(block).forward
    monkeypatch.setattr(type(block), "forward", lambda self, *a, **kw: stock(self, *a, **kw))
    undo = fuse_norm_quantization(t)
    assert "_modulate" not in vars(block)
    undo()


def test_the_recipe_puts_the_form_in_unless_told_not_to(calls: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    t, _ = _model()
    block = t.transformer_blocks[0]
    undo = QwenImage21Recipe().compiled_forms(t)
    assert "_modulate" in vars(block) and "forward" in vars(block.img_norm2)
    undo()
    assert "_modulate" not in vars(block)
    monkeypatch.setattr(QwenImage21Recipe, "fused_norm_fp8", False)
    undo = QwenImage21Recipe().compiled_forms(t)
    assert "_modulate" not in vars(block) and "forward" in vars(block.img_mlp)
    undo()
