"""Text padding only where every attention processor takes the mask (accel/hooks/recipes/padding_gate.py),
on a tiny Qwen-Image pipeline with emulated graphs and the recipe's CUDA-only call normalisation
switched on, as on a GPU."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from accel import accelerate_pipeline
from accel.hooks import graph_hook, report
from accel.hooks.recipes import padding_gate
from accel.hooks.recipes.padding_gate import processors_dropping, refusal
from pipelines.builders import build_pipeline, build_transformer
from pipelines.families.qwen_image.recipe import QwenImageRecipe
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.generate import generate

MASK = "encoder_hidden_states_mask"


class ArgsKwargs(QwenDoubleStreamAttnProcessor2_0):
    """Wraps the stock processor as IP-Adapter and attention-map tools do, naming no keyword."""

    def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(attn, *args, **kwargs)


class Named(QwenDoubleStreamAttnProcessor2_0):
    """A user's processor that names the mask and passes it on."""

    def __call__(self, attn: Any, hidden_states: Any, encoder_hidden_states: Any = None, **kwargs: Any) -> Any:
        return super().__call__(attn, hidden_states, encoder_hidden_states, **kwargs)


def test_processors_that_do_not_name_the_mask_are_found() -> None:
    t = build_transformer("qwen-image", "tiny")
    assert processors_dropping(t, MASK) == [] and refusal(t, MASK) is None
    t.transformer_blocks[1].attn.set_processor(ArgsKwargs())
    assert processors_dropping(t, MASK) == ["transformer_blocks.1.attn (ArgsKwargs)"]
    t.set_attn_processor(ArgsKwargs())
    said = refusal(t, MASK)
    assert said is not None and said.startswith("the attention processor of transformer_blocks.0.attn (ArgsKwargs) and")
    assert f"take no {MASK}" in said
    # Naming the keyword is what counts (diffusers' own test), not the processor's class.
    t.set_attn_processor(Named())
    assert processors_dropping(t, "encoder_hidden_states") == [] and processors_dropping(t, MASK) != []


def test_ulysses_padding_is_refused_in_one_line_while_a_processor_drops_the_mask() -> None:
    recipe = QwenImageRecipe()
    text = {"encoder_hidden_states": torch.randn(1, 7, 8)}
    recipe.padding_refused = "the attention processor of x (P) takes no mask"
    with pytest.raises(ValueError, match="7-token text does not split over 2 Ulysses ranks and cannot be padded"):
        recipe.prepare_context_parallel(torch.nn.Identity(), (), text, 2)
    assert recipe.prepare_context_parallel(torch.nn.Identity(), (), {"encoder_hidden_states": torch.randn(1, 8, 8)}, 2)
    assert recipe.inexact() is None
    recipe.padding_refused = None
    assert recipe.inexact() is not None and recipe.inexact()[1] == "text_buckets=None"
    assert QwenImageRecipe(text_buckets=None).inexact() is None


@pytest.fixture
def padded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    emulate_pipelines(monkeypatch)
    # The recipe pads only where graphs run on CUDA: here, as there.
    monkeypatch.setattr(graph_hook, "module_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(report, "module_device", lambda m: torch.device("cuda"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pipe() -> Any:
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any, prompt: str = "a lighthouse in a storm") -> torch.Tensor:
    return generate(pipe, prompt, negative_prompt="blurry", guidance=4.0, steps=2, seed=3)


def _processors(pipe: Any, cls: type) -> None:
    pipe.transformer.set_attn_processor(cls())


@torch.no_grad()
def test_text_is_padded_only_while_every_processor_takes_the_mask(padded, monkeypatch, caplog) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe, capture_on_miss=True, cfg_batch=False)
    padded_call = _call(pipe)
    hook = pipe.accel.hooks["transformer"]
    # Padded: a masked bucket, within float noise of the stock call, and said so in the report.
    assert torch.allclose(padded_call, _call(stock), rtol=0, atol=1e-4)
    assert "image: not the stock pipeline's bit for bit" in pipe.accel.report()
    assert "text_buckets=None" in pipe.accel.report()
    graphs = len(pipe.accel.runners["transformer"].store.entries)
    for p in (pipe, stock):
        _processors(p, ArgsKwargs)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="accel"):
        got = _call(pipe)
        again = _call(pipe, "another prompt, of other length than the first one")
    assert torch.equal(got, _call(stock)) and torch.equal(
        again, _call(stock, "another prompt, of other length than the first one")
    )
    said = [r.getMessage() for r in caplog.records if "text is not padded" in r.getMessage()]
    assert len(said) == 1 and "transformer_blocks.0.attn (ArgsKwargs)" in said[0], said
    assert hook.recipe.padding_refused is not None
    text = pipe.accel.report()
    assert "image: the stock pipeline's, bit for bit" in text and "text not padded: the attention processor" in text
    assert len(pipe.accel.runners["transformer"].store.entries) >= graphs + 2  # one graph per text length
    # The control: the same call padded anyway attends the padding, far off the stock image.
    monkeypatch.setattr(padding_gate, "refusal", lambda module, keyword: None)
    for p in (pipe, stock):
        _processors(p, ArgsKwargs)  # a new state: the gate looks again
    wrong = _call(pipe)
    assert (wrong - _call(stock)).abs().max() > 1e-3
    monkeypatch.setattr(padding_gate, "refusal", refusal)
    # Back to processors that take the mask: padded again.
    for p in (pipe, stock):
        _processors(p, QwenDoubleStreamAttnProcessor2_0)
    padded_again = _call(pipe)
    assert hook.recipe.padding_refused is None and torch.equal(padded_again, padded_call)
