"""Qwen-Image 2.1's query and key head norms and rotation as one op
(pipelines/families/qwen_image_21/head_norms.py) on the CPU, where the op is the modules'
arithmetic: the transformer with the form gives the same bits as without it, at the prefix K/V
cache's extract and cached steps and without the cache, text and condition images; the extract step
stores the same K/V; norms that are not diffusers' own take diffusers' function; dynamo traces a
block with the form in one graph holding the op; under emulated graphs, with the K/V cache, the
pipeline with the form replays every step bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

import accel
from pipelines.builders import build_transformer
from pipelines.families.qwen_image.forms import qwen_rope_in_real_arithmetic
from pipelines.families.qwen_image_21.head_norms import fuse_head_norms
from pipelines.families.qwen_image_21.layout import MODULE, LayoutMemo, layout_forward
from tests.pipelines.families.test_qwen_image_21 import _forward_inputs, replays_with_forms, traced_first_block


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The op's calls: whether each was given a cached prefix."""
    seen: list[Any] = []
    op = accel.head_norm_rope
    monkeypatch.setattr(
        "pipelines.families.qwen_image_21.head_norms.head_norm_rope",
        lambda x, w, eps, f, prefix=None: seen.append(prefix is not None) or op(x, w, eps, f, prefix),
    )
    return seen


def _model() -> tuple[torch.nn.Module, Any]:
    t = build_transformer("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    return t, layout_forward(t.forward, LayoutMemo())


def _inputs(seed: int = 0, **kw: Any) -> dict[str, Any]:
    inputs = _forward_inputs(torch.Generator().manual_seed(seed), **kw)
    return {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _steps(forward: Any, blocks: int, inputs: dict[str, Any], later: dict[str, Any]) -> tuple[Any, ...]:
    """One call without the cache, an extract step and a cached one (another step's latents)."""
    cache = QwenImage21KVCache(blocks)
    plain = forward(**inputs)[0]
    extract = forward(**inputs, kv_cache=cache, kv_cache_mode="extract")[0]
    cached = forward(**later, kv_cache=cache, kv_cache_mode="cached")[0]
    return plain, extract, cached, cache


@torch.no_grad()
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_transformer_with_the_form_gives_the_same_bits(calls: list[Any], condition: bool) -> None:
    t, forward = _model()
    blocks = len(t.transformer_blocks)
    inputs = _inputs(condition=condition, padded=True)
    later = {**inputs, "hidden_states": torch.randn_like(inputs["hidden_states"])}
    undo_rope = qwen_rope_in_real_arithmetic(MODULE)  # as the recipe puts both in
    try:
        want = _steps(forward, blocks, inputs, later)
        assert not calls
        undo = fuse_head_norms()
        try:
            got = _steps(forward, blocks, inputs, later)
        finally:
            undo()
    finally:
        undo_rope()
    for g, w in zip(got[:3], want[:3]):
        assert torch.equal(g, w)
    for g, w in zip(got[3].layer_caches, want[3].layer_caches):
        assert torch.equal(g.k, w.k) and torch.equal(g.v, w.v)
    # Queries and keys of every block at the three calls; only the cached step's keys take a prefix.
    assert len(calls) == 3 * 2 * blocks
    assert sum(calls) == blocks and all(calls[-2 * blocks + 1 :: 2])


@torch.no_grad()
def test_norms_that_are_not_diffusers_own_take_diffusers_function(calls: list[Any]) -> None:
    t, forward = _model()
    attn = t.transformer_blocks[0].attn
    inputs = _inputs(condition=False, padded=False)
    want = forward(**inputs)[0]
    norm = attn.norm_k
    undo = fuse_head_norms()
    try:
        norm.forward = lambda x, _n=norm: type(_n).forward(_n, x)  # a forward of its own
        got = forward(**inputs)[0]
    finally:
        del norm.forward
        undo()
    assert torch.equal(got, want)
    assert len(calls) == 2 * (len(t.transformer_blocks) - 1)  # every block but the first


def test_dynamo_traces_a_block_with_the_form_in_one_graph() -> None:
    t, forward = _model()
    eager, compiled, seen = traced_first_block(t, forward, _inputs(condition=True, padded=True), [fuse_head_norms])
    assert torch.equal(eager, compiled)
    assert torch.ops.bcg_diffusers.head_norm_rope.default in seen


def test_the_recipe_puts_the_form_in_only_where_its_flag_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from accel import unpatched
    from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe

    mod = sys.modules[MODULE]
    stock = unpatched(mod, "_qwenimage21_prepare_qkv")
    t, _ = _model()
    for flag in (False, True):
        monkeypatch.setattr(QwenImage21Recipe, "fused_head_norms", flag)
        undo = QwenImage21Recipe().compiled_forms(t)
        try:
            assert (mod._qwenimage21_prepare_qkv is not stock) is flag
        finally:
            undo()
        assert mod._qwenimage21_prepare_qkv is stock


@pytest.mark.parametrize(("image", "cfg"), [(False, False), (True, True)], ids=["t2i-kv", "image-cfg-kv"])
def test_with_the_form_graphs_replay_every_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any], image: bool, cfg: bool
) -> None:
    """Under emulated graphs (tests/helpers/emulator.py) with the K/V cache: the form's op captured
    and replayed, the cached keys read from the extract step's stores; three calls after the
    warm-up equal the same pipeline run eagerly with the form, with no miss, eager call or capture."""
    want, got, _ = replays_with_forms(
        monkeypatch, lambda pipe: [qwen_rope_in_real_arithmetic(MODULE), fuse_head_norms()], image, cfg
    )
    assert any(calls) and not all(calls)  # the eager calls took the form, the cached keys a prefix
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
