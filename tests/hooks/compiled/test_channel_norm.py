"""accel.hooks.compiled.channel_norm on the CPU: which norms are recognised, the route's values and
its compile count, the stock path off the GPU, undo, and a CPU pipeline under compile=True keeping
its decoder's norms (inductor runs on CUDA)."""

from __future__ import annotations

import shutil

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm
from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21RMS_norm
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from accel import accelerate_pipeline
from accel.hooks.compiled import channel_norm
from accel.hooks.compiled.channel_norm import compile_channel_norms, is_channel_rms_norm
from pipelines.builders import build_pipeline

NORMS = (QwenImage21RMS_norm, QwenImageRMS_norm, WanRMS_norm)


class LookAlike(torch.nn.Module):  # the same attributes, not diffusers' code
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.channel_first, self.scale, self.bias = True, dim**0.5, 0.0
        self.gamma = torch.nn.Parameter(torch.ones(dim, 1, 1))


class Subclass(WanRMS_norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_only_diffusers_channel_first_norms_without_a_forward_of_their_own_are_recognised() -> None:
    for cls in NORMS:
        assert is_channel_rms_norm(cls(8)) and is_channel_rms_norm(cls(8, images=False, bias=True)), cls
        assert not is_channel_rms_norm(cls(8, channel_first=False)), cls
    own = WanRMS_norm(8)
    own.forward = own.forward
    assert not is_channel_rms_norm(own)
    assert not is_channel_rms_norm(LookAlike(8))
    assert not is_channel_rms_norm(torch.nn.RMSNorm(8))
    # A subclass defined elsewhere with its own forward: its module is not diffusers'.
    assert not is_channel_rms_norm(Subclass(8))
    # diffusers' class with a forward that computes otherwise (as a later version might).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WanRMS_norm, "forward", lambda self, x: torch.nn.functional.normalize(x, dim=1) * self.gamma)
        assert not is_channel_rms_norm(WanRMS_norm(8))
    assert is_channel_rms_norm(WanRMS_norm(8))


@torch.no_grad()
def test_every_rank_channel_count_and_batch_size_is_one_of_few_compiles() -> None:
    """Traced with a backend that runs the traced graph as it is: the route's values are the stock
    module's bits (inductor's own rounding is the GPU test's), and a decoder's ranks (4-D images,
    5-D one-frame videos), channel counts, scales and batch sizes compile a few times, not per layer."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(channel_norm.channel_rms_norm, dynamic=True, fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    for n in (2, 1, 3):
        for c, shape, images, bias in ((16, (1, 5, 6), False, False), (32, (7, 7), True, True), (8, (1, 3, 4), False, True), (64, (2, 2), True, False)):  # fmt: skip
            for cls in NORMS:
                norm = cls(c, images=images, bias=bias).bfloat16()
                norm.gamma.normal_(generator=g)
                if bias:
                    norm.bias.normal_(generator=g)
                x = (torch.randn(n, c, *shape, generator=g) * 3).bfloat16()
                got = channel_norm._as_rows(compiled, x, norm)
                assert got.shape == x.shape and got.dtype == x.dtype
                assert torch.equal(got, norm(x)), (cls, n, c, shape)
    # Batch 1 (dynamo specialises sizes of 1) and larger, with and without a bias.
    assert len(graphs) <= 4, f"{len(graphs)} compiles"
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
@torch.no_grad()
def test_inductor_rounds_where_the_stock_norm_rounds(monkeypatch) -> None:
    """The route's own compile, run by inductor on the CPU: the stock module's bits (each product
    and the sum rounded to bf16 as the eager ops round them), batch 1 and 2, with and without bias."""
    monkeypatch.setattr(channel_norm, "_compiled", None)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    try:
        for n, c, shape, bias in ((1, 32, (1, 9, 10), False), (2, 48, (6, 7), True)):
            norm = QwenImage21RMS_norm(c, images=len(shape) == 2, bias=bias).bfloat16()
            norm.gamma.normal_(generator=g)
            if bias:
                norm.bias.normal_(generator=g)
            x = (torch.randn(n, c, *shape, generator=g) * 3).bfloat16()
            assert torch.equal(channel_norm._as_rows(channel_norm._channel_rms_norm(), x, norm), norm(x))
    finally:
        torch._dynamo.reset()


@torch.no_grad()
def test_norms_are_routed_until_undone_and_the_cpu_runs_the_stock_way(monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(channel_norm, "_channel_rms_norm", lambda: lambda *a: calls.append(a) or a[0])
    norm, kept = QwenImage21RMS_norm(8, images=False), QwenImage21RMS_norm(8, channel_first=False)
    model = torch.nn.Sequential(norm, torch.nn.SiLU(), kept)
    x = torch.randn(2, 8, 1, 3, 8)
    want = model(x)
    undo = compile_channel_norms(model, tmp_path)
    try:
        assert [m for m in model.modules() if "forward" in vars(m)] == [norm]
        assert torch.equal(model(x), want) and calls == []  # a CPU tensor: the stock forward

        class FakeCuda(torch.Tensor):
            is_cuda = True

        forward = vars(norm)["forward"]
        y = torch.randn(1, 8, 1, 4, 4).as_subclass(FakeCuda)
        assert forward(y) is not None and len(calls) == 1
        rows, gamma, bias, scale = calls[0]
        assert rows.shape == (1, 8, 16) and gamma.shape == (8, 1) and bias is None and scale == 8**0.5
        with torch.enable_grad():  # a backward: the stock way (inductor's kernel has none here)
            forward(torch.randn(1, 8, 1, 4, 4))
        assert len(calls) == 1
    finally:
        undo()
    assert not any("forward" in vars(m) for m in model.modules())
    assert compile_channel_norms(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


@pytest.mark.parametrize("compile", [True, False])
def test_a_cpu_pipeline_keeps_its_decoder_norms(compile: bool) -> None:
    pipe = build_pipeline("qwen-image-2.1", "tiny")
    accelerate_pipeline(pipe, compile=compile)
    try:
        # Recognised only without a forward of their own: still all there, so none was routed.
        norms = [m for m in pipe.vae.decoder.modules() if type(m) is QwenImage21RMS_norm]
        assert norms and all(is_channel_rms_norm(m) for m in norms)
    finally:
        pipe.accel.restore()
    assert not any("forward" in vars(m) for m in pipe.vae.decoder.modules())
