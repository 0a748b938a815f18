"""The real-arithmetic rotary form of compile=True: equal to diffusers' complex product (bit for
bit on the CPU, where both round the same way), installed only while compiled blocks need them."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image import forms
from pipelines.families.qwen_image.forms import (
    QWEN_MODULE,
    qwen_rope_in_real_arithmetic,
    rotate_pairs,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_pairs_is_the_complex_product(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 3, 16, generator=g).to(dtype)
    freqs = torch.polar(torch.rand(37, 8, generator=g) + 0.5, torch.randn(37, 8, generator=g)).unsqueeze(1)
    complex_x = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    want = torch.view_as_real(complex_x * freqs).flatten(3).type_as(x)
    got = rotate_pairs(x, freqs)
    assert got.dtype == dtype and torch.equal(got, want)


def _latents(pipe) -> torch.Tensor:
    kwargs = dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, output_type="latent")
    if "true_cfg_scale" in inspect.signature(pipe.__call__).parameters:
        kwargs.update(true_cfg_scale=4.0, negative_prompt="blurry")
    return pipe(**kwargs, generator=torch.Generator().manual_seed(1)).images


def test_qwen_form_equals_diffusers_and_is_undone() -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    want = _latents(pipe)
    mod = sys.modules[QWEN_MODULE]
    stock = mod.apply_rotary_emb_qwen
    undo = qwen_rope_in_real_arithmetic()
    try:
        assert mod.apply_rotary_emb_qwen is not stock
        calls = []
        real = forms.rotate_pairs
        forms.rotate_pairs = lambda *a: calls.append(1) or real(*a)  # counts the calls taking the form
        try:
            got = _latents(pipe)
        finally:
            forms.rotate_pairs = real
        assert calls, "the patched helper never took the real-arithmetic path"
        assert torch.equal(got, want)
        x = torch.randn(1, 2, 4, 8)  # [B, H, S, D] on this path
        cos_sin = (torch.randn(4, 8), torch.randn(4, 8))  # use_real=True: diffusers' own path
        assert torch.equal(mod.apply_rotary_emb_qwen(x, cos_sin, use_real=True), stock(x, cos_sin, use_real=True))
    finally:
        undo()
    assert mod.apply_rotary_emb_qwen is stock


def test_without_cuda_compile_leaves_the_stock_forms(caplog) -> None:
    from diffusers.models.activations import GELU

    pipe = build_pipeline("qwen-image", "tiny")
    stock = sys.modules[QWEN_MODULE].apply_rotary_emb_qwen
    accelerate_pipeline(pipe, compile=True)  # no CUDA: nothing compiles, so nothing else changes
    try:
        assert sys.modules[QWEN_MODULE].apply_rotary_emb_qwen is stock
        assert not any("forward" in vars(m) for m in pipe.transformer.modules() if isinstance(m, GELU))
    finally:
        pipe.accel.restore()
