"""Text padding only where every attention processor takes the mask and every attention backend in
use applies it (accel/hooks/recipes/padding_gate.py, mask_backends.py), on tiny Qwen-Image and
Z-Image pipelines with emulated graphs and the recipes' CUDA-only call normalisation switched on,
as on a GPU. ``_native_flash`` (a backend that refuses masks) runs on the CPU too, so the
backend cases run the real one; the registry's own test doubles stand in for the rest."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, attention_backend
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from accel import accelerate_pipeline
from accel.hooks.recipes import padding_gate
from accel.hooks.recipes.mask_backends import backend_refusal, backends_in_use
from accel.hooks.recipes.padding_gate import processors_dropping, refusal
from pipelines.builders import build_pipeline, build_transformer
from pipelines.families.qwen_image.recipe import QwenImageRecipe
from tests.helpers.after_warmup import as_on_cuda, tiny
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
    as_on_cuda(monkeypatch, host_copies=False)
    # set_attention_backend sets diffusers' process-wide backend too: given back after the test.
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    # The recipe pads only where graphs run on CUDA: here, as there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pipe() -> Any:
    return tiny("qwen-image")


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


# -- attention backends ---------------------------------------------------------------------------
def test_which_backends_take_a_mask_is_asked_of_diffusers_registry(monkeypatch) -> None:
    assert backend_refusal("native") is None and backend_refusal(AttentionBackendName._NATIVE_MATH) is None
    flash = backend_refusal("_native_flash")
    assert flash is not None and "`attn_mask` is not supported for native flash attention" in flash
    for name in ("flash", "_flash_3", "sage", "_sage_qk_int8_pv_fp8_cuda_sm90"):  # they raise before any kernel
        assert "refuses masks" in (backend_refusal(name) or ""), name
    # The varlen backends count the mask's tokens on the host: not shown to take it, so refused.
    assert "could not be shown" in (backend_refusal("flash_varlen") or "")
    assert backend_refusal("no-such-backend") == "diffusers knows no attention backend 'no-such-backend'"

    # Test doubles registered in diffusers' own registry (under a member no test runs): one whose
    # function names no attn_mask (the dispatch would drop it), one that applies it, one that raises.
    member = AttentionBackendName.XFORMERS

    def register(fn: Any) -> None:
        monkeypatch.setitem(_AttentionBackendRegistry._backends, member, fn)
        monkeypatch.setitem(_AttentionBackendRegistry._constraints, member, [])
        monkeypatch.setitem(
            _AttentionBackendRegistry._supported_arg_names, member, set(inspect.signature(fn).parameters)
        )

    def drops(query, key, value, dropout_p=0.0, is_causal=False, scale=None):
        return query

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        assert attn_mask is not None and attn_mask.dtype == torch.bool
        return query

    def raises(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if attn_mask is not None:
            raise ValueError("my kernel takes no attn_mask")
        return query

    register(drops)
    assert "takes no attn_mask, which diffusers' dispatch drops" in (backend_refusal(member) or "")
    register(applies)
    assert backend_refusal("xformers") is None
    register(raises)
    assert "my kernel takes no attn_mask" in (backend_refusal(member) or "")


def test_the_backend_of_each_processor_is_its_own_else_the_active_one(monkeypatch) -> None:
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", AttentionBackendName.NATIVE)
    t = build_transformer("qwen-image", "tiny")
    paths = [f"transformer_blocks.{i}.attn" for i in range(len(t.transformer_blocks))]
    assert backends_in_use(t) == {"native": paths} and refusal(t, MASK) is None
    t.transformer_blocks[1].attn.processor._attention_backend = AttentionBackendName._NATIVE_FLASH
    assert backends_in_use(t) == {"native": [paths[0], *paths[2:]], "_native_flash": [paths[1]]}
    said = refusal(t, MASK)
    assert said is not None and said.startswith(f"the attention backend _native_flash (of {paths[1]}) takes no mask")
    t.transformer_blocks[1].attn.processor._attention_backend = None
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", AttentionBackendName._NATIVE_FLASH)
    said = refusal(t, MASK)
    assert said is not None and f"(of {paths[0]} and {len(paths) - 1} more)" in said
    # A processor that drops the mask is said first: nothing reaches the backend then.
    t.transformer_blocks[0].attn.set_processor(ArgsKwargs())
    assert "ArgsKwargs" in (refusal(t, MASK) or "")


def _flash_everywhere(pipe: Any) -> None:
    pipe.transformer.set_attention_backend("_native_flash")  # the processors' and the process-wide one


def _native_everywhere(pipe: Any) -> None:
    pipe.transformer.reset_attention_backend()  # the processors' only: diffusers leaves the active one
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


@torch.no_grad()
def test_qwen_text_is_not_padded_while_a_backend_refuses_the_mask(padded, caplog) -> None:
    """After a capture with padded text, every way a backend that refuses masks comes in: the
    stock pipeline's call, bit for bit, said once; padded again once it is gone."""
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe, capture_on_miss=True)
    padded_call = _call(pipe)
    hook = pipe.accel.hooks["transformer"]
    assert hook.recipe.padding_refused is None and "text_buckets=None" in pipe.accel.report()
    # The control: without the backends' half of the gate the padded call hands the mask to the
    # backend, which raises, captured or not (the stock pipeline, which pads nothing, runs).
    with pytest.MonkeyPatch.context() as mp, attention_backend("_native_flash"):
        mp.setattr(padding_gate, "backends_refusing", lambda module: [])
        with pytest.raises(ValueError, match="not supported for native flash"):
            _call(pipe)
    for change, back in (
        (_flash_everywhere, _native_everywhere),
        (
            lambda p: _AttentionBackendRegistry.set_active_backend(AttentionBackendName._NATIVE_FLASH),
            _native_everywhere,
        ),
        (
            lambda p: setattr(
                p.transformer.transformer_blocks[0].attn.processor, "_attention_backend", "_native_flash"
            ),
            lambda p: setattr(p.transformer.transformer_blocks[0].attn.processor, "_attention_backend", None),
        ),
    ):
        for p in (pipe, stock):
            change(p)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="accel"):
            got = _call(pipe)
            again = _call(pipe, "another prompt, of other length than the first one")
        assert torch.equal(got, _call(stock))
        assert torch.equal(again, _call(stock, "another prompt, of other length than the first one"))
        said = [r.getMessage() for r in caplog.records if "text is not padded" in r.getMessage()]
        assert len(said) == 1 and "the attention backend _native_flash" in said[0], said
        assert "image: the stock pipeline's, bit for bit" in pipe.accel.report()
        for p in (pipe, stock):
            back(p)
        # Back where the first call was: its graphs replayed, nothing captured again (diffusers'
        # reset leaves each processor an instance `_attention_backend = None` beside the class's).
        captures = pipe.accel.stats()["transformer"].captures
        assert torch.equal(_call(pipe), padded_call) and hook.recipe.padding_refused is None
        assert pipe.accel.stats()["transformer"].captures == captures, change
    # diffusers' context manager sets the process-wide backend around the call: looked at per call.
    with attention_backend("_native_flash"):
        assert torch.equal(_call(pipe), _call(stock)) and hook.recipe.padding_refused is not None
    assert torch.equal(_call(pipe), padded_call)


@torch.no_grad()
def test_z_image_under_a_backend_that_refuses_masks_is_the_stock_pipeline(padded) -> None:
    pipe, stock = build_pipeline("z-image", "tiny"), build_pipeline("z-image", "tiny")
    for p in (pipe, stock):
        p.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe, capture_on_miss=True)

    def call(p: Any, prompt: str = "a lighthouse in a storm") -> torch.Tensor:
        return generate(p, prompt, negative_prompt="blurry", guidance=4.0, steps=2, seed=3)

    assert torch.equal(call(pipe), call(stock))
    captures = pipe.accel.stats()["transformer"].captures
    for p in (pipe, stock):
        _flash_everywhere(p)
    for prompt in ("a lighthouse in a storm", "a fox"):  # the same caption multiple of 32: no mask
        assert torch.equal(call(pipe, prompt), call(stock, prompt))
    stats = pipe.accel.stats()["transformer"]
    assert stats.captures > captures and stats.eager_calls == 0  # the new backend's graphs, replayed
