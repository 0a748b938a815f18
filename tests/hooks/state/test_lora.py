"""LoRA through diffusers' API under graphs, on tiny pipelines with emulated graphs.

Adapters added, switched, scaled, disabled, fused and deleted after a capture: each call equals a
stock pipeline that did the same, bit for bit. A change of weights (an adapter added or deleted)
drops the graphs; a change of Python state alone (which adapters are active, at what scale)
keys graphs by state, so switching back to a state replays its graphs with no capture; an
in-place hot-swap of an adapter's weights needs no capture at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import peft
import pytest
import torch
from peft.utils import get_peft_model_state_dict

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline, build_transformer
from tests.helpers.generate import generate

NAMES = [
    "qwen-image",
    "z-image",
    "qwen-image-2.1",  # with its prefix K/V cache (the pipeline's default): request-scoped state
]
TARGETS = ["to_q", "to_k", "to_v"]


def _pipe(name: str) -> Any:
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return generate(pipe, negative_prompt="blurry", guidance=4.0, steps=2, seed=5)


def _accelerate(pipe: Any) -> None:
    accelerate_pipeline(pipe, text_encoder=False, vae=False)
    with pipe.accel.runners["transformer"].capturing():
        _call(pipe)


def _config(**kw: Any) -> peft.LoraConfig:
    # Random B as well as A: a LoRA as trained, which changes the image.
    return peft.LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False, **kw)


def _add(pipe: Any, adapter: str, seed: int, **kw: Any) -> None:
    torch.manual_seed(seed)
    pipe.transformer.add_adapter(_config(**kw), adapter_name=adapter)


def _lora_file(name: str, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA as a file holds it: the denoiser's adapter weights under diffusers' prefix."""
    t = build_transformer(name, "tiny")
    torch.manual_seed(seed)
    t.add_adapter(_config(), adapter_name="x")
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(t, adapter_name="x").items()}


# (label, change, what the next call costs: "captured" (new graphs), "kept" (no capture))
STEPS: list[tuple[str, Callable[[Any], Any], str]] = [
    ("adapter a added", lambda p: _add(p, "a", 1), "captured"),
    ("adapter b added", lambda p: _add(p, "b", 2), "captured"),
    ("set_adapters a", lambda p: p.transformer.set_adapters("a"), "captured"),
    ("set_adapters b at 0.5", lambda p: p.transformer.set_adapters("b", 0.5), "captured"),
    ("set_adapters a (b's scale is 0.5 now)", lambda p: p.transformer.set_adapters("a"), "captured"),
    ("set_adapters b at 0.5 again", lambda p: p.transformer.set_adapters("b", 0.5), "kept"),
    ("set_adapters a again", lambda p: p.transformer.set_adapters("a"), "kept"),
    ("a and b", lambda p: p.transformer.set_adapters(["a", "b"], [1.0, 0.3]), "captured"),
    ("disable_lora", lambda p: p.transformer.disable_lora(), "captured"),
    ("enable_lora", lambda p: p.transformer.enable_lora(), "kept"),
    ("fuse_lora", lambda p: p.transformer.fuse_lora(), "captured"),
    ("unfuse_lora", lambda p: p.transformer.unfuse_lora(), "kept"),
    ("b deleted", lambda p: p.transformer.delete_adapters("b"), "captured"),
    ("a DoRA adapter", lambda p: _add(p, "d", 3, use_dora=True), "captured"),
]


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_lora_changes_equal_stock_and_switching_back_replays_kept_graphs(name: str, emulated) -> None:
    pipe, stock = _pipe(name), _pipe(name)
    _accelerate(pipe)
    before = _call(pipe)
    assert torch.equal(before, _call(stock))
    seen: list[torch.Tensor] = [before]
    for label, change, cost in STEPS:
        change(pipe)
        change(stock)
        st = pipe.accel.stats()["transformer"]
        got, want = _call(pipe), _call(stock)
        assert torch.equal(got, want), f"{label}: max diff {(got - want).abs().max()}"
        after = pipe.accel.stats()["transformer"]
        assert after.eager_calls == st.eager_calls and after.replays > st.replays, f"{label}: ran eagerly"
        if cost == "kept":
            assert after.captures == st.captures, f"{label}: captured again"
            # A state seen before (unfuse_lora subtracts what fuse_lora added: equal up to rounding).
            assert any(torch.allclose(got, s, rtol=0, atol=1e-4) for s in seen), f"{label}: not a state seen before"
        else:
            assert after.captures > st.captures, f"{label}: replayed graphs of another state"
        seen.append(got)
    assert not torch.equal(seen[-1], before)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_hot_swap_needs_no_capture_and_load_state_dict_captures_again(name: str, emulated) -> None:
    first, second = _lora_file(name, 1), _lora_file(name, 2)
    pipe, stock = _pipe(name), _pipe(name)
    for p in (pipe, stock):
        p.enable_lora_hotswap(target_rank=8)
        p.load_lora_weights(first, adapter_name="style")
    _accelerate(pipe)
    before = _call(pipe)
    assert torch.equal(before, _call(stock))
    for lora in (second, first, second):
        captures = pipe.accel.stats()["transformer"].captures
        for p in (pipe, stock):
            p.load_lora_weights(lora, adapter_name="style", hotswap=True)
        got, want = _call(pipe), _call(stock)
        assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"
        assert pipe.accel.stats()["transformer"].captures == captures  # read in place by the replay
        assert torch.equal(got, before) is (lora is first)
    # An in-place write that bumps the tensors' versions is captured again (the graphs of one
    # state of the weights), and equals stock.
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in stock.transformer.state_dict().items()}
    for p in (pipe, stock):
        p.transformer.load_state_dict(state)
    captures = pipe.accel.stats()["transformer"].captures
    got, want = _call(pipe), _call(stock)
    assert torch.equal(got, want) and not torch.equal(got, before)
    assert pipe.accel.stats()["transformer"].captures > captures
