"""FLUX.1's single-stream compiled form on the CPU: the same block in real arithmetic, taken only
where it restates diffusers' code, undone with its holder (the fused epilogue itself runs on CUDA)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

from accel import accelerate_pipeline, recipe_for
from pipelines.builders import build_pipeline
from pipelines.families.flux import forms
from pipelines.families.flux.forms import single_blocks_without_concat
from pipelines.families.flux.recipe import FluxRecipe


def _block(seed: int = 0) -> FluxSingleTransformerBlock:
    torch.manual_seed(seed)
    block = FluxSingleTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).eval()
    for p in block.parameters():  # diffusers zero-initialises nothing here, but make every weight count
        p.data.normal_(0, 0.2)
    return block


def _inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 12, 32, generator=g), torch.randn(2, 5, 32, generator=g), torch.randn(2, 32, generator=g))


@torch.no_grad()
def test_the_form_is_the_stock_block_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _block()
    hidden, text, temb = _inputs()
    want = block(hidden, text, temb)
    calls = []
    real = forms.addmm_gelu_tanh
    monkeypatch.setattr(forms, "addmm_gelu_tanh", lambda *a: calls.append(1) or real(*a))
    undo = single_blocks_without_concat(torch.nn.ModuleList([block]))
    try:
        assert "forward" in vars(block)
        got = block(hidden, text, temb)
    finally:
        undo()
    assert calls == [1], "the block did not take the form"
    assert "forward" not in vars(block)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        # The same function; the split product sums in another order, so equal to rounding only.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert not torch.equal(g, torch.zeros_like(g))


@torch.no_grad()
def test_a_replaced_projection_or_gradients_run_the_stock_block(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _block()
    hidden, text, temb = _inputs()
    calls = []
    monkeypatch.setattr(forms, "addmm_gelu_tanh", lambda *a: calls.append(1))
    undo = single_blocks_without_concat(block)
    try:

        class Wrapped(torch.nn.Linear):  # a LoRA layer stands in its place
            pass

        stock_proj = block.proj_mlp
        wrapped = Wrapped(32, 128)
        wrapped.load_state_dict(stock_proj.state_dict())
        block.proj_mlp = wrapped
        out = block(hidden, text, temb)
        block.proj_mlp = stock_proj
        with torch.enable_grad():
            grad_out = block(hidden, text, temb)
    finally:
        undo()
    assert calls == [], "the form ran where it would bypass a layer or a backward"
    assert torch.equal(out[1], block(hidden, text, temb)[1])
    assert grad_out[1].requires_grad


def test_another_diffusers_or_class_keeps_the_stock_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    class Sub(FluxSingleTransformerBlock):
        pass

    torch.manual_seed(0)
    sub = Sub(dim=32, num_attention_heads=2, attention_head_dim=16)
    block = _block()
    undo = single_blocks_without_concat(torch.nn.ModuleList([sub]))
    assert "forward" not in vars(sub)
    undo()
    monkeypatch.setattr(forms, "FORM_VERSIONS", ">=99")
    undo = single_blocks_without_concat(block)
    assert "forward" not in vars(block)
    undo()


def test_flux_gets_its_recipe_and_no_form_without_cuda() -> None:
    pipe = build_pipeline("flux", "tiny")
    assert recipe_for(pipe.transformer) is FluxRecipe
    accelerate_pipeline(pipe, compile=True)  # no CUDA: nothing compiles, so no form either
    try:
        assert pipe.accel.recipes["transformer"].name == "flux"
        blocks = pipe.transformer.single_transformer_blocks
        assert len(blocks) and not any("forward" in vars(b) for b in blocks)
    finally:
        pipe.accel.restore()


def test_the_form_is_ours_to_the_caches_binding_and_a_forward_over_it_is_not() -> None:
    """Graphs stay on under the form (the binding once took it for a foreign forward and switched
    them off); a forward someone writes over it still switches them off."""
    from accel.hooks.caches.binding import find_caches

    pipe = build_pipeline("flux", "tiny")
    model = pipe.transformer
    undo = single_blocks_without_concat(model)
    try:
        _, _, foreign = find_caches(model, "bcg")
        assert foreign == []
        block = model.single_transformer_blocks[0]
        ours = block.forward
        block.__dict__["forward"] = lambda *a, **k: ours(*a, **k)
        _, _, foreign = find_caches(model, "bcg")
        assert len(foreign) == 1 and "single_transformer_blocks.0" in foreign[0]
        block.__dict__["forward"] = ours
    finally:
        undo()
