"""A backend that refuses masks after a capture, on real CUDA graphs: Qwen-Image with its default
options (text buckets, joined guidance) pads text and hands the transformer a mask, which
``_native_flash`` refuses (``ValueError: attn_mask is not supported``). The gate (accel/hooks/
recipes/padding_gate.py) stops padding while that backend is in use, so the call is the stock
pipeline's, bit for bit, and padded again once the backend is gone. The CPU twin is
tests/hooks/recipes/test_padding_gate.py; the state matrix has the same row on both models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda

DEV = "cuda"
PROMPT = "a lighthouse in a storm"
OTHER = "a red fox in fresh snow at dawn, a long prompt of another length"


@pytest.fixture(autouse=True)
def backend_given_back() -> Iterator[None]:
    """set_attention_backend sets diffusers' process-wide backend too: given back after each test."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active


def _pipe() -> Any:
    pipe = build_pipeline("qwen-image", "tiny", device=DEV, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any, prompt: str = PROMPT) -> torch.Tensor:
    return generate(pipe, prompt, size=(128, 128), steps=3, seed=0, device=DEV, guidance=4.0, negative_prompt="blurry")


@torch.no_grad()
def test_native_flash_after_a_capture_gives_the_stock_image() -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe, capture_on_miss=True)
    pipe.accel.warmup((128, 128), prompts=[PROMPT], negative_prompt="blurry", progress=False)
    padded = _call(pipe)
    hook = pipe.accel.hooks["transformer"]
    assert hook.recipe.padding_refused is None and "text_buckets=None" in pipe.accel.report()
    for p in (pipe, stock):
        p.transformer.set_attention_backend("_native_flash")
    for prompt in (PROMPT, OTHER):
        got, want = _call(pipe, prompt), _call(stock, prompt)
        assert torch.equal(got, want), f"{prompt!r}: max diff {(got.float() - want.float()).abs().max()}"
    report = pipe.accel.report()
    assert "image: the stock pipeline's, bit for bit" in report and "attention backend _native_flash" in report
    stats = pipe.accel.stats()["transformer"]
    assert stats.capture_failures == 0, pipe.accel.report()
    # Back to the default backend: padded again, the first call's graphs replayed.
    for p in (pipe, stock):
        p.transformer.reset_attention_backend()
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
    captures = pipe.accel.stats()["transformer"].captures
    assert torch.equal(_call(pipe), padded) and hook.recipe.padding_refused is None
    assert pipe.accel.stats()["transformer"].captures == captures
    pipe.accel.restore()
