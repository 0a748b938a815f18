"""Float8 attention in ``quantize="fp8"``'s selection (accel/hooks/fp8/attention_layers.py), on
the CPU: the Linear layers through the grid stand-in (tests/helpers/fake_quant.py), FlashAttention-3
through the wheel's stand-in (tests/helpers/fake_fa3.py), which computes float8 attention with the
per-head descales as the kernel does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks import graph_hook, report
from accel.hooks.attention import backends, fa3
from accel.hooks.fp8.attention_layers import FlashAttentionFloat8, attention_layers
from accel.hooks.fp8.layer_select import distance, select_layers
from accel.hooks.recipes.mask_backends import backends_in_use
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image.recipe import QwenImageRecipe
from tests.helpers import fake_fa3
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.fake_fa3 import use_fake_fa3
from tests.helpers.fake_quant import GridQuantizer, use_grid
from tests.helpers.generate import generate

ATTENTION = ("transformer_blocks.0.attn", "transformer_blocks.1.attn")


@pytest.fixture
def wheel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_fa3(monkeypatch)
    monkeypatch.setattr(fa3, "_said", set())
    yield
    backends.unregister()


def _pipe() -> Any:
    pipe = build_pipeline("qwen-image", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe: Any) -> torch.Tensor:
    return generate(pipe, steps=2, guidance=4.0, negative_prompt="blurry")


def _backends(pipe: Any) -> dict[str, list[str]]:
    return backends_in_use(pipe.transformer)


def _select(pipe: Any, budget: float, levels: int = 64):  # type: ignore[no-untyped-def]
    keep = {"transformer": QwenImageRecipe.fp8_keep}
    run = lambda: _run(pipe)  # noqa: E731
    return select_layers(
        {"transformer": pipe.transformer}, GridQuantizer(levels=levels), keep, run, budget, FlashAttentionFloat8()
    )


@torch.no_grad()
def test_attention_on_flashattention3_is_a_candidate_measured_with_the_linear_layers(wheel: None) -> None:
    pipe = _pipe()
    assert attention_layers({"transformer": pipe.transformer}, FlashAttentionFloat8()) == ([], [])  # not on FA3
    held = backends.set_backend(pipe.transformer, backends.FA3)
    ref = _run(pipe)
    sel = _select(pipe, budget=1.0)
    assert sel.attention == ATTENTION and sel.attention_kept == ()
    assert sel.attention_backend == "FlashAttention-3 float8"
    assert all(0 < sel.errors[name] < 0.1 for name in ATTENTION)
    assert _backends(pipe) == {backends.FA3_FP8: list(ATTENTION)}
    fake_fa3.calls.clear()
    assert distance(_run(pipe), ref) == (sel.error, sel.max_abs)  # the state left is the state measured
    assert {c["dtype"] for c in fake_fa3.calls} == {torch.float8_e4m3fn}
    held()


@torch.no_grad()
def test_a_budget_no_float8_meets_keeps_the_attention_in_bf16_too(wheel: None) -> None:
    pipe = _pipe()
    held = backends.set_backend(pipe.transformer, backends.FA3)
    sel = _select(pipe, budget=1e-9)
    assert sel.attention == () and set(sel.attention_kept) == set(ATTENTION)
    assert _backends(pipe) == {backends.FA3: list(ATTENTION)}
    held()


@torch.no_grad()
def test_a_recipe_keep_pattern_keeps_attention_in_bf16_and_says_so(wheel: None) -> None:
    """Qwen-Image 2.1's recipe keeps its attention in bf16 (float8 measured slower there): no
    attention is a candidate, the report names them kept by the recipe, the Linear layers still go."""
    from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe

    pipe = build_pipeline("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    names = [n for n, m in pipe.transformer.named_modules() if n.endswith(".attn")]
    held = backends.set_backend(pipe.transformer, backends.FA3)
    assert [a.name for a in attention_layers({"transformer": pipe.transformer}, FlashAttentionFloat8())[0]] == names
    sel = select_layers(
        {"transformer": pipe.transformer},
        GridQuantizer(levels=64),
        {"transformer": QwenImage21Recipe.fp8_keep},
        lambda: generate(pipe, steps=2),
        1.0,
        FlashAttentionFloat8(),
    )
    assert sel.attention == () and sel.attention_backend is None and sel.attention_by_recipe == tuple(names)
    assert not set(names) & set(sel.kept_by_recipe)  # that list is of Linear layers
    assert _backends(pipe) == {backends.FA3: names}
    assert any(n.startswith("transformer_blocks.") for n in sel.quantized)  # the block's Linear layers
    held()


@torch.no_grad()
def test_the_search_ranks_attention_with_the_linear_layers_by_their_errors(wheel: None) -> None:
    """Linear layers rounded far less than float8 attention: the attention is the worst, and a
    budget between the two keeps it in bf16 first."""
    pipe = _pipe()
    held = backends.set_backend(pipe.transformer, backends.FA3)
    loose = _select(pipe, budget=1.0, levels=127)
    ranked = sorted(loose.errors, key=loose.errors.get, reverse=True)
    assert set(ranked[:2]) == set(ATTENTION)
    held()
    pipe = _pipe()
    held = backends.set_backend(pipe.transformer, backends.FA3)
    tight = _select(pipe, budget=loose.error * 0.5, levels=127)
    assert tight.attention_kept and tight.attention_kept[0] == ranked[0]
    assert tight.error <= loose.error * 0.5
    held()


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    emulate_pipelines(monkeypatch)
    monkeypatch.setattr(graph_hook, "module_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(report, "module_device", lambda m: torch.device("cuda"))
    yield


@torch.no_grad()
def test_the_warmup_selects_float8_attention_replays_it_and_restore_takes_it_out(
    wheel: None, graphs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_grid(monkeypatch, levels=64)
    pipe = _pipe()
    accelerate_pipeline(pipe, attention="fa3", quantize="fp8", fp8_budget=1.0)
    pipe.accel.warmup((64, 64), prompts=["a lighthouse in a storm"], negative_prompt="blurry", progress=False)
    sel = pipe.accel.quantization.selection
    assert sel is not None and sel.attention == ATTENTION
    assert _backends(pipe) == {backends.FA3_FP8: list(ATTENTION)}
    text = pipe.accel.report()
    assert (
        "    attention: 2 of 2 layers in float8 (FlashAttention-3 float8: float8 queries, keys and values, "
        "per-head scales, keys smoothed): transformer_blocks.0.attn, transformer_blocks.1.attn" in text
    )
    assert ", 2 attention layers in float8 (0 in bf16);" in pipe.accel.quantization.summary()
    runner = pipe.accel.runners["transformer"]
    replays = runner.counts.replays
    graphed = generate(pipe, "a lighthouse in a storm", negative_prompt="blurry", guidance=4.0, steps=2)
    assert runner.counts.replays > replays
    runner.enabled = False  # the same quantized model, run eagerly through the same hook
    eager = generate(pipe, "a lighthouse in a storm", negative_prompt="blurry", guidance=4.0, steps=2)
    runner.enabled = True
    assert torch.equal(graphed, eager)
    pipe.accel.restore()
    assert backends.FA3_FP8 not in _backends(pipe) and backends.FA3 not in _backends(pipe)


@torch.no_grad()
def test_qwen_image_21_warms_up_float8_layers_with_bf16_fa3_attention_and_says_so(
    wheel: None, graphs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_grid(monkeypatch, levels=64)
    pipe = build_pipeline("qwen-image-2.1", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe, attention="fa3", quantize="fp8", fp8_budget=1.0)
    pipe.accel.warmup((64, 64), prompts=["a lighthouse in a storm"], progress=False)
    sel = pipe.accel.quantization.selection
    names = ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]
    assert sel is not None and sel.quantized and sel.attention == () and list(sel.attention_by_recipe) == names
    assert _backends(pipe) == {backends.FA3: names}
    assert "    attention: 2 layers kept in bf16 by the recipe" in pipe.accel.report()
    assert ", attention in bf16 (the recipe's 2);" in pipe.accel.quantization.summary()
    runner = pipe.accel.runners["transformer"]
    replays = runner.counts.replays
    graphed = generate(pipe, "a lighthouse in a storm", steps=3)
    assert runner.counts.replays > replays
    runner.enabled = False
    assert torch.equal(graphed, generate(pipe, "a lighthouse in a storm", steps=3))
    runner.enabled = True
    pipe.accel.restore()


@torch.no_grad()
def test_without_flashattention3_nothing_of_the_attention_is_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    use_grid(monkeypatch, levels=64)
    pipe = _pipe()
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=1.0)
    pipe.accel.warmup((64, 64), prompts=["a fox"], progress=False)
    sel = pipe.accel.quantization.selection
    assert sel.attention == () and sel.attention_backend is None
    assert "    attention:" not in pipe.accel.report()
    pipe.accel.restore()
