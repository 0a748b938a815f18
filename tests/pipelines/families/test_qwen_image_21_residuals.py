"""Qwen-Image 2.1's gated residual updates as one op each (pipelines/families/qwen_image_21/residuals.py)
on the CPU, where the op is the tensor ops' arithmetic: the transformer with the form (and the
gates' rows from fused_norms.py) gives the same bits as without it, at the prefix K/V cache's steps
and without the cache, text and condition images; without the rows, or for a
block with a forward of its own, diffusers' expression runs; dynamo traces a block with the form in
one graph holding the op; the recipe's flag puts it in; under emulated graphs with the K/V cache the
pipeline with the form replays every step bit for bit."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

import accel
from pipelines.builders import build_transformer
from pipelines.families.qwen_image.forms import qwen_rope_in_real_arithmetic
from pipelines.families.qwen_image_21.fused_norms import fuse_norm_quantization
from pipelines.families.qwen_image_21.layout import MODULE, LayoutMemo, layout_forward
from pipelines.families.qwen_image_21.residuals import fuse_residuals
from tests.helpers.traced import traced
from tests.pipelines.families.test_qwen_image_21 import _forward_inputs, first_block_kwargs

FORM = "pipelines.families.qwen_image_21.residuals"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The op's calls: whether each was given the target-token mask."""
    seen: list[Any] = []
    op = accel.gated_residual
    monkeypatch.setattr(f"{FORM}.gated_residual", lambda h, o, g, m=None: seen.append(m is not None) or op(h, o, g, m))
    return seen


def _model() -> tuple[torch.nn.Module, Any]:
    t = build_transformer("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    return t, layout_forward(t.forward, LayoutMemo())


def _inputs(seed: int = 0, **kw: Any) -> dict[str, Any]:
    inputs = _forward_inputs(torch.Generator().manual_seed(seed), **kw)
    return {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _steps(forward: Any, blocks: int, inputs: dict[str, Any], later: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """One call without the cache, an extract step and a cached one (another step's latents)."""
    cache = QwenImage21KVCache(blocks)
    plain = forward(**inputs)[0]
    extract = forward(**inputs, kv_cache=cache, kv_cache_mode="extract")[0]
    cached = forward(**later, kv_cache=cache, kv_cache_mode="cached")[0]
    return plain, extract, cached


@torch.no_grad()
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_transformer_with_the_form_gives_the_same_bits(calls: list[Any], condition: bool) -> None:
    t, forward = _model()
    blocks = len(t.transformer_blocks)
    inputs = _inputs(condition=condition, padded=True)
    later = {**inputs, "hidden_states": torch.randn_like(inputs["hidden_states"])}
    want = _steps(forward, blocks, inputs, later)
    undo = [fuse_norm_quantization(t), fuse_residuals(t)]
    try:
        got = _steps(forward, blocks, inputs, later)
    finally:
        for u in reversed(undo):
            u()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # Both updates of every block at the three calls, the gates' rows spread by the target-token
    # mask (the text's tokens take the last row, t = 0).
    assert len(calls) == 3 * 2 * blocks and all(calls)
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


def test_dynamo_traces_a_block_with_the_form_in_one_graph() -> None:
    t, forward = _model()
    block = t.transformer_blocks[0]
    args = first_block_kwargs(t, forward, _inputs(condition=True, padded=True))
    undo = [fuse_norm_quantization(t), fuse_residuals(t)]
    try:
        with torch.no_grad():
            eager = block(**args)
            compiled, seen = traced(block, **args)
    finally:
        for u in reversed(undo):
            u()
    assert torch.equal(eager, compiled)
    assert seen.count(torch.ops.bcg_diffusers.gated_residual.default) == 2


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


@pytest.mark.parametrize(("image", "cfg"), [(False, False), (True, True)], ids=["t2i-kv", "image-cfg-kv"])
def test_with_the_form_graphs_replay_every_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any], image: bool, cfg: bool
) -> None:
    """Under emulated graphs (tests/helpers/emulator.py) with the K/V cache: the form's op captured
    and replayed; three calls after the warm-up equal the same pipeline run eagerly with the form,
    with no miss, eager call or capture."""
    from accel import accelerate_pipeline
    from tests.helpers.after_warmup import as_on_cuda
    from tests.pipelines.families.test_qwen_image_21 import (
        PROMPTS,
        SIDE,
        _call,
        _condition_image,
        _counts,
        _pipe,
        _seeds,
    )

    as_on_cuda(monkeypatch)
    given: dict[str, Any] = dict(use_kv_cache=True)
    if image:
        given.update(image=_condition_image(), output_resolution=SIDE)
    guidance = dict(true_cfg_scale=4.0, negative_prompt=" ") if cfg else {}
    seeds = _seeds(len(PROMPTS))
    pipe = _pipe()
    undo = [qwen_rope_in_real_arithmetic(MODULE), fuse_norm_quantization(pipe.transformer), fuse_residuals(pipe.transformer)]  # fmt: skip
    try:
        want = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
        assert calls and all(calls)  # the eager calls took the form
        accelerate_pipeline(pipe)
        pipe.accel.warmup([(SIDE, SIDE)], prompts=list(PROMPTS), cfg=cfg, call_kwargs=given, progress=False)
        before = _counts(pipe)
        got = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
    finally:
        for u in reversed(undo):
            u()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
    assert _counts(pipe)["transformer"] == before["transformer"] and pipe.accel.stats()["transformer"].replays > 0
