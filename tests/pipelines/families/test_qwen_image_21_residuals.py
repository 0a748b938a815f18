"""Qwen-Image 2.1's gated residual updates as one op each (pipelines/families/qwen_image_21/residuals.py)
on the CPU, where the op is the tensor ops' arithmetic: the transformer with the form (and the
gates' rows from fused_norms.py) gives the same bits as without it, at the prefix K/V cache's steps
and without the cache, text and condition images, with the gates' tanh in the op or in the block;
without the rows, or for a block with a forward of its own, diffusers' expression runs; dynamo
traces a block with the form in one graph holding the op (and the gates' tanh); the recipe's flags
put it in; under emulated graphs with the K/V cache the pipeline with the form replays every step
bit for bit."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import accel
from pipelines.families.qwen_image.forms import qwen_rope_in_real_arithmetic
from pipelines.families.qwen_image_21.fused_norms import fuse_norm_quantization
from pipelines.families.qwen_image_21.layout import MODULE
from pipelines.families.qwen_image_21.residuals import fuse_residuals
from tests.pipelines.families.test_qwen_image_21 import replays_with_forms, traced_first_block
from tests.pipelines.families.test_qwen_image_21_head_norms import _inputs, _model, _steps

FORM = "pipelines.families.qwen_image_21.residuals"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The op's calls: whether each was given the target-token mask, and whether it took the tanh."""
    seen: list[Any] = []
    op = accel.gated_residual

    def call(h: Any, o: Any, g: Any, m: Any = None, tanh: bool = True) -> Any:
        seen.append((m is not None, tanh))
        return op(h, o, g, m, tanh=tanh)

    monkeypatch.setattr(f"{FORM}.gated_residual", call)
    return seen


@torch.no_grad()
@pytest.mark.parametrize("tanh_in_block", [False, True], ids=["tanh-in-op", "tanh-in-block"])
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_transformer_with_the_form_gives_the_same_bits(
    calls: list[Any], condition: bool, tanh_in_block: bool
) -> None:
    t, forward = _model()
    blocks = len(t.transformer_blocks)
    inputs = _inputs(condition=condition, padded=True)
    later = {**inputs, "hidden_states": torch.randn_like(inputs["hidden_states"])}
    want = _steps(forward, blocks, inputs, later)
    undo = [fuse_norm_quantization(t, contiguous_scales=tanh_in_block), fuse_residuals(t, tanh_in_block=tanh_in_block)]
    try:
        got = _steps(forward, blocks, inputs, later)
    finally:
        for u in reversed(undo):
            u()
    assert all(torch.equal(g, w) for g, w in zip(got[:3], want[:3]))  # the three calls' outputs
    # Both updates of every block at the three calls, the gates' rows spread by the target-token
    # mask (the text's tokens take the last row, t = 0).
    assert calls == [(True, not tanh_in_block)] * (3 * 2 * blocks)
    assert not any("forward" in vars(b) for b in t.transformer_blocks)


@torch.no_grad()
def test_without_the_rows_or_for_a_forward_of_its_own_diffusers_expression_runs(calls: list[Any]) -> None:
    t, forward = _model()
    inputs = _inputs(condition=True, padded=False)
    want = forward(**inputs)[0]
    undo = fuse_residuals(t)  # the stock _modulate: gates already spread over the tokens
    try:
        assert torch.equal(forward(**inputs)[0], want) and calls == []
    finally:
        undo()
    block = t.transformer_blocks[0]
    block.forward = lambda *a, _b=block, **kw: type(_b).forward(_b, *a, **kw)  # a forward of its own
    own = block.forward
    undo = [fuse_norm_quantization(t), fuse_residuals(t)]
    try:
        got = forward(**inputs)[0]
        assert vars(block)["forward"] is own
    finally:
        for u in reversed(undo):
            u()
        del block.forward
    assert torch.equal(got, want)
    assert len(calls) == 2 * (len(t.transformer_blocks) - 1)  # every block but the first


@pytest.mark.parametrize("tanh_in_block", [False, True], ids=["tanh-in-op", "tanh-in-block"])
def test_dynamo_traces_a_block_with_the_form_in_one_graph(tanh_in_block: bool) -> None:
    t, forward = _model()
    inputs = _inputs(condition=True, padded=True)
    forms = [
        lambda: fuse_norm_quantization(t, contiguous_scales=tanh_in_block),
        lambda: fuse_residuals(t, tanh_in_block=tanh_in_block),
    ]
    eager, compiled, seen = traced_first_block(t, forward, inputs, forms)
    assert torch.equal(eager, compiled)
    assert seen.count(torch.ops.bcg_diffusers.gated_residual.default) == 2
    # In the block's graph: one tanh for both gates' rows, where inductor can fuse it.
    assert seen.count(torch.tanh) == (1 if tanh_in_block else 0)


def test_the_recipe_puts_the_form_in_only_where_its_flag_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe

    t, _ = _model()
    for flag in (False, True):
        monkeypatch.setattr(QwenImage21Recipe, "fused_residuals", flag)
        undo = QwenImage21Recipe().compiled_forms(t)
        try:
            assert all(("forward" in vars(b)) is flag for b in t.transformer_blocks)
        finally:
            undo()
        assert not any("forward" in vars(b) for b in t.transformer_blocks)
    assert sys.modules[FORM].fuse_residuals is fuse_residuals
    assert QwenImage21Recipe.modulation_in_block is False  # off until a GPU measures it


def test_the_recipe_hands_its_modulation_flag_to_both_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.families.qwen_image_21 import recipe as module

    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        module, "fuse_residuals", lambda m, tanh_in_block=False: seen.append(("tanh", tanh_in_block)) or (lambda: None)
    )
    monkeypatch.setattr(
        module,
        "fuse_norm_quantization",
        lambda m, contiguous_scales=False: seen.append(("scales", contiguous_scales)) or (lambda: None),
    )
    t, _ = _model()
    for flag in (False, True):
        monkeypatch.setattr(module.QwenImage21Recipe, "modulation_in_block", flag)
        module.QwenImage21Recipe().compiled_forms(t)()
    assert sorted(seen) == [("scales", False), ("scales", True), ("tanh", False), ("tanh", True)]


@pytest.mark.parametrize(
    ("image", "cfg", "tanh_in_block"),
    [(False, False, False), (True, True, False), (True, True, True)],
    ids=["t2i-kv", "image-cfg-kv", "image-cfg-kv-tanh-in-block"],
)
def test_with_the_form_graphs_replay_every_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any], image: bool, cfg: bool, tanh_in_block: bool
) -> None:
    """Under emulated graphs (tests/helpers/emulator.py) with the K/V cache: the form's op captured
    and replayed; three calls after the warm-up equal the same pipeline run eagerly with the form,
    with no miss, eager call or capture."""

    def forms(pipe: Any) -> list:
        t = pipe.transformer
        return [
            qwen_rope_in_real_arithmetic(MODULE),
            fuse_norm_quantization(t, contiguous_scales=tanh_in_block),
            fuse_residuals(t, tanh_in_block=tanh_in_block),
        ]

    want, got, _ = replays_with_forms(monkeypatch, forms, image, cfg)
    # The eager calls took the form, the gates spread by the mask, their tanh where it was asked.
    assert calls and set(calls) == {(True, not tanh_in_block)}
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
