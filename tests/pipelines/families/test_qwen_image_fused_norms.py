"""Qwen-Image's second modulated LayerNorm writing its feed-forward's float8 input
(pipelines/families/qwen_image/fused_norms.py, accel/hooks/fp8/norm_quant.py) on the CPU: the
op's reference is the modules' arithmetic, so blocks with the form give the unfused blocks' bits,
with the library's float8 layers (torch._scaled_mm runs on the CPU too); anything else takes
diffusers' path; dynamo traces a block with the form in one graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel
from accel.hooks.compiled.fused import fuse_gelu_epilogues
from accel.hooks.fp8 import norm_quant, scaled_mm
from accel.hooks.fp8.norm_quant import modulated_norm_rows_e4m3, modulated_norm_rows_reference
from accel.hooks.fp8.row_quant import quantize_rows_reference
from accel.hooks.fp8.scaled_mm import Float8RowwiseLinear, ScaledMMFloat8
from pipelines.builders import build_transformer
from pipelines.families.qwen_image import fused_norms
from pipelines.families.qwen_image.fused_norms import fuse_norm_quantization
from tests.helpers.traced import traced


def test_the_reference_is_layer_norm_then_the_modulation_then_the_row_quantization() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 64, generator=g).bfloat16() * 3
    shift, scale = (torch.randn(2, 64, generator=g).bfloat16() for _ in range(2))
    q, s = modulated_norm_rows_e4m3(x, shift, scale, 1e-6)
    y = F.layer_norm(x, (64,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    want_q, want_s = quantize_rows_reference(y.reshape(-1, 64))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert q.shape == (14, 64) and s.shape == (14, 1)
    got = modulated_norm_rows_reference(x, shift, scale, 1e-6)
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(ValueError, match=r"takes x \(batch, tokens, K\), shift \(or None\) and scale \(M, K\)"):
        modulated_norm_rows_e4m3(x, shift[:1], scale, 1e-6)


def _blocks(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, dict]:
    """A tiny Qwen-Image in bf16 with its feed-forwards in the library's float8 layers, and one
    block's inputs."""
    monkeypatch.setattr(scaled_mm, "check_fp8_device", lambda device, what="": None)
    t = build_transformer("qwen-image", "tiny", dtype=torch.bfloat16)
    names = [f"transformer_blocks.{i}.img_mlp.net.{j}" for i in range(2) for j in ("0.proj", "2")]
    assert ScaledMMFloat8().quantize(t, names) == names
    g = torch.Generator().manual_seed(1)
    dim = t.inner_dim
    args = dict(
        hidden_states=torch.randn(2, 16, dim, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(2, 5, dim, generator=g).bfloat16(),
        encoder_hidden_states_mask=None,
        temb=torch.randn(2, dim, generator=g).bfloat16(),
        image_rotary_emb=t.pos_embed([(1, 4, 4)], max_txt_seq_len=5, device="cpu"),
    )
    return t, args


@torch.no_grad()
def test_blocks_with_the_form_give_the_unfused_blocks_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    t, args = _blocks(monkeypatch)
    undo_gelu = fuse_gelu_epilogues(t)
    want = [block(**args) for block in t.transformer_blocks]
    calls = []
    op = norm_quant.modulated_norm_rows_e4m3
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: calls.append(1) or op(*a))
    undo = fuse_norm_quantization(t)
    got = [block(**args) for block in t.transformer_blocks]
    assert len(calls) == 2  # one per block, through the form
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # Undone: diffusers' (and fused.py's) forwards again.
    undo()
    block = t.transformer_blocks[0]
    assert "_modulate" not in vars(block) and "forward" not in vars(block.img_norm2)
    undo_gelu()
    assert "forward" not in vars(block.img_mlp)


@torch.no_grad()
def test_bf16_feed_forwards_and_recorded_gradients_take_diffusers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    t = build_transformer("qwen-image", "tiny", dtype=torch.bfloat16)
    _, args = _blocks(monkeypatch)
    block = t.transformer_blocks[0]
    want = block(**args)
    undo = fuse_norm_quantization(t)
    calls = []
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: calls.append(1))
    got = block(**args)
    assert not calls and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    # The norm's module used on its own is itself (a plain LayerNorm for a bf16 feed-forward).
    assert isinstance(block.img_norm2(args["hidden_states"]), torch.Tensor)
    undo()


@torch.no_grad()
def test_an_attention_input_and_the_text_stream_stay_diffusers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only img_norm2's output becomes pending; the block's other norms hand on tensors."""
    t, args = _blocks(monkeypatch)
    undo = fuse_norm_quantization(t)
    block = t.transformer_blocks[0]
    x = args["hidden_states"]
    for norm in (block.img_norm1, block.txt_norm1, block.txt_norm2):
        assert isinstance(norm(x), torch.Tensor)
    pending = block.img_norm2(x)
    assert isinstance(pending, fused_norms.Normed)
    mod = torch.randn(2, 3 * t.inner_dim).bfloat16()
    modulated, gate = block._modulate(pending, mod)
    assert isinstance(modulated, fused_norms.Modulated) and gate.shape == (2, 1, t.inner_dim)
    stock, stock_gate = type(block)._modulate(block, F.layer_norm(x, (x.shape[-1],), eps=block.img_norm2.eps), mod)
    assert torch.equal(modulated.tensor(), stock) and torch.equal(gate, stock_gate)
    undo()


def test_dynamo_traces_a_block_with_the_form_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    t, args = _blocks(monkeypatch)
    # Both undos held: a patch nothing holds is undone (accel.graphs.patches).
    undo = [fuse_gelu_epilogues(t), fuse_norm_quantization(t)]
    block = t.transformer_blocks[0]
    with torch.no_grad():
        eager = block(**args)
        compiled, seen = traced(block, **args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    assert isinstance(block.img_mlp.net[2], Float8RowwiseLinear)
    # The form is what dynamo traced: the fused norm's op, and no GELU written out.
    assert torch.ops.bcg_diffusers.modulated_norm_rows_e4m3.default in seen
    assert F.gelu not in seen and torch.ops.aten.gelu.default not in seen
    for u in reversed(undo):
        u()


@torch.no_grad()
def test_layers_measured_through_their_forward_take_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize="fp8"'s selection measures a float8 layer by wrapping its forward: the block then
    calls that forward (its error measured), not the fused op."""
    t, args = _blocks(monkeypatch)
    undo = [fuse_gelu_epilogues(t), fuse_norm_quantization(t)]  # held, or they are undone at once
    block = t.transformer_blocks[0]
    assert "forward" in vars(block.img_mlp) and "_modulate" in vars(block)
    up = block.img_mlp.net[0].proj
    seen = []
    stock = up.forward
    up.forward = lambda h: seen.append(h) or stock(h)
    calls = []
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: calls.append(1))
    block(**args)
    assert seen and not calls
    for u in reversed(undo):
        u()


@torch.no_grad()
def test_the_recipe_fuses_only_when_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unverified on a GPU (tests/cuda/test_fused_quant.py), the fused form is off by default: the
    recipe's compiled forms leave the norms diffusers', and put the form in when opted in."""
    from pipelines.families.qwen_image.recipe import QwenImageRecipe

    t, args = _blocks(monkeypatch)
    undo_gelu = fuse_gelu_epilogues(t)  # held, or it is undone at once
    calls = []
    op = norm_quant.modulated_norm_rows_e4m3
    monkeypatch.setattr(accel, "modulated_norm_rows_e4m3", lambda *a: calls.append(1) or op(*a))
    assert QwenImageRecipe.fused_norm_fp8 is False
    undo = QwenImageRecipe().compiled_forms(t)
    block = t.transformer_blocks[0]
    assert "_modulate" not in vars(block) and "forward" not in vars(block.img_norm2)
    want = block(**args)
    assert not calls
    undo()
    monkeypatch.setattr(QwenImageRecipe, "fused_norm_fp8", True)
    undo = QwenImageRecipe().compiled_forms(t)
    assert "_modulate" in vars(block) and "forward" in vars(block.img_norm2)
    got = block(**args)
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    undo()
    assert "_modulate" not in vars(block)
    undo_gelu()
