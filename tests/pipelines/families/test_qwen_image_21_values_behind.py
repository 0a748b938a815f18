"""Qwen-Image 2.1's float8 value projections written behind the cached values
(``QwenImage21Recipe.values_behind_prefix``: pipelines/families/qwen_image_21/head_norms.py,
accel/hooks/fp8/scaled_mm.py) on the CPU, where ``torch._scaled_mm`` runs too: the op is the
concatenation of the prefix and the same product, bit for bit, whatever the prefix's length; the
layer takes it only at batch 1 in its own dtype and concatenates otherwise; the transformer with
the form gives the concatenating form's bits at the extract and cached steps, the op called at
the cached step only; dynamo traces a cached block with it in one graph; the recipe's flag puts
it in; under emulated graphs, with the K/V cache, the pipeline replays every step bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from accel import Float8RowwiseLinear, PendingRows
from accel.hooks.fp8 import scaled_mm
from accel.hooks.fp8.scaled_mm import ScaledMMFloat8, scaled_mm_rowwise, scaled_mm_rowwise_behind
from pipelines.builders import build_transformer
from pipelines.families.qwen_image.forms import qwen_rope_in_real_arithmetic
from pipelines.families.qwen_image_21.fused_norms import fuse_norm_quantization
from pipelines.families.qwen_image_21.head_norms import fuse_head_norms
from pipelines.families.qwen_image_21.layout import MODULE, LayoutMemo, layout_forward
from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe, fuse_swiglu
from tests.pipelines.families.test_qwen_image_21 import _forward_inputs, replays_with_forms, traced_first_block

LAYERS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The op's calls: the prefix's length of each."""
    seen: list[int] = []
    op = scaled_mm.scaled_mm_rowwise_behind
    monkeypatch.setattr(scaled_mm, "scaled_mm_rowwise_behind", lambda *a: seen.append(a[-1].shape[0]) or op(*a))
    monkeypatch.setattr(scaled_mm, "check_fp8_device", lambda device, what="": None)
    return seen


def _layer(seed: int = 0, bias: bool = True) -> Float8RowwiseLinear:
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(64, 48, bias=bias).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(48, generator=g))
    return Float8RowwiseLinear(linear)


@pytest.mark.parametrize("p", [0, 1, 7])
def test_the_op_is_the_prefix_then_the_same_product(p: int) -> None:
    layer = _layer()
    g = torch.Generator().manual_seed(p)
    x = torch.randn(5, 64, generator=g).bfloat16()
    prefix = torch.randn(p, 48, generator=g).bfloat16()
    xq, xs = scaled_mm.quantize_rows_e4m3(x)
    args = (xq, layer.qweight.t(), xs, layer.weight_scale, layer.bias)
    got = scaled_mm_rowwise_behind(*args, prefix)
    want = torch.cat([prefix, scaled_mm_rowwise(*args, torch.bfloat16)])
    assert got.shape == (p + 5, 48) and torch.equal(got, want)


@torch.no_grad()
def test_the_layer_writes_behind_at_batch_one_and_concatenates_otherwise(calls: list[int]) -> None:
    layer = _layer(bias=False)
    g = torch.Generator().manual_seed(1)

    class Rows(PendingRows):
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        def e4m3_rows(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
            xq, xs = scaled_mm.quantize_rows_e4m3(self.x.reshape(-1, 64))
            return xq, xs, tuple(self.x.shape[:-1])

    for batch, dtype, taken in [(1, torch.bfloat16, True), (2, torch.bfloat16, False), (1, torch.float32, False)]:
        x = torch.randn(batch, 6, 64, generator=g).bfloat16()
        prefix = torch.randn(batch, 3, 48, generator=g).to(dtype)
        want = torch.cat([prefix, layer(x)], dim=1)
        for given in (x, Rows(x)):
            calls.clear()
            got = layer.forward_behind(given, prefix)
            assert torch.equal(got, want) and got.shape == (batch, 9, 48)
            assert calls == ([3] if taken else [])


def _model() -> tuple[torch.nn.Module, Any]:
    t = build_transformer("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    names = [f"transformer_blocks.{i}.{n}" for i in range(len(t.transformer_blocks)) for n in LAYERS]
    assert ScaledMMFloat8().quantize(t, names) == names
    return t, layout_forward(t.forward, LayoutMemo())


def _inputs(seed: int = 0, **kw: Any) -> dict[str, Any]:
    inputs = _forward_inputs(torch.Generator().manual_seed(seed), batch=1, **kw)
    return {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _steps(t: torch.nn.Module, forward: Any, values_behind: bool, condition: bool) -> tuple[Any, ...]:
    """An extract step and two cached ones (other latents) under the compiled forms."""
    inputs = _inputs(condition=condition, padded=False)
    g = torch.Generator().manual_seed(5)
    undo = [
        qwen_rope_in_real_arithmetic(MODULE),
        fuse_swiglu(t),
        fuse_head_norms(values_behind),
        fuse_norm_quantization(t),
    ]
    try:
        cache = QwenImage21KVCache(len(t.transformer_blocks))
        out = [forward(**inputs, kv_cache=cache, kv_cache_mode="extract")[0]]
        for _ in range(2):
            later = {**inputs, "hidden_states": torch.randn(inputs["hidden_states"].shape, generator=g).bfloat16()}
            out.append(forward(**later, kv_cache=cache, kv_cache_mode="cached")[0])
    finally:
        for u in reversed(undo):
            u()
    return (*out, cache)


@torch.no_grad()
@pytest.mark.parametrize("condition", [False, True], ids=["t2i", "condition-image"])
def test_the_transformer_with_the_form_gives_the_concatenating_forms_bits(calls: list[int], condition: bool) -> None:
    t, forward = _model()
    want = _steps(t, forward, False, condition)
    assert not calls
    got = _steps(t, forward, True, condition)
    for g, w in zip(got[:3], want[:3]):
        assert torch.equal(g, w)
    for g, w in zip(got[3].layer_caches, want[3].layer_caches):
        assert torch.equal(g.k, w.k) and torch.equal(g.v, w.v)
    # The two cached steps, every block, behind the whole cached prefix.
    prefix = want[3].layer_caches[0].v.shape[1]
    assert calls == [prefix] * (2 * len(t.transformer_blocks)) and prefix > 0


@torch.no_grad()
def test_a_value_projection_measured_through_its_forward_concatenates(calls: list[int]) -> None:
    t, forward = _model()
    want = _steps(t, forward, False, False)
    to_v = t.transformer_blocks[0].attn.to_v
    to_v.forward = lambda h, _l=to_v: type(_l).forward(_l, h)
    try:
        got = _steps(t, forward, True, False)
    finally:
        del to_v.forward
    assert all(torch.equal(g, w) for g, w in zip(got[:3], want[:3]))
    assert len(calls) == 2 * (len(t.transformer_blocks) - 1)  # every block but the first


def test_dynamo_traces_a_cached_block_with_the_form_in_one_graph() -> None:
    t, forward = _model()
    inputs = _inputs(condition=True, padded=False)
    cache = QwenImage21KVCache(len(t.transformer_blocks))
    forms = [lambda: qwen_rope_in_real_arithmetic(MODULE), lambda: fuse_head_norms(True)]
    with torch.no_grad():
        undo = [f() for f in forms]
        try:
            forward(**inputs, kv_cache=cache, kv_cache_mode="extract")
        finally:
            for u in reversed(undo):
                u()
    cached = {**inputs, "kv_cache": cache, "kv_cache_mode": "cached"}
    eager, compiled, seen = traced_first_block(t, forward, cached, forms)
    assert torch.equal(eager, compiled)
    assert torch.ops.bcg_diffusers.scaled_mm_rowwise_behind.default in seen


def test_the_recipe_puts_the_form_in_only_where_its_flag_says(
    calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, forward = _model()
    inputs = _inputs(condition=False, padded=False)
    assert QwenImage21Recipe.values_behind_prefix is True  # on by default (measured on an H100)
    for flag in (False, True):
        monkeypatch.setattr(QwenImage21Recipe, "values_behind_prefix", flag)
        calls.clear()
        undo = QwenImage21Recipe().compiled_forms(t)
        try:
            with torch.no_grad():
                cache = QwenImage21KVCache(len(t.transformer_blocks))
                forward(**inputs, kv_cache=cache, kv_cache_mode="extract")
                forward(**inputs, kv_cache=cache, kv_cache_mode="cached")
        finally:
            undo()
        assert bool(calls) is flag


def test_with_the_form_graphs_replay_every_step_bit_for_bit(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    """Under emulated graphs (tests/helpers/emulator.py) with the K/V cache, the pipeline in bf16
    with the library's float8 layers: the op captured and replayed, the cached values read from
    the extract step's stores; three calls after the warm-up equal the same pipeline run eagerly
    with the form, with no miss, eager call or capture."""

    def forms(pipe: Any) -> list:
        pipe.to(torch.bfloat16)
        t = pipe.transformer
        names = [f"transformer_blocks.{i}.{n}" for i in range(len(t.transformer_blocks)) for n in LAYERS]
        ScaledMMFloat8().quantize(t, names)
        return [qwen_rope_in_real_arithmetic(MODULE), fuse_swiglu(t), fuse_head_norms(True), fuse_norm_quantization(t)]

    want, got, _ = replays_with_forms(monkeypatch, forms, False, False)
    assert calls  # the eager calls took the form
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
