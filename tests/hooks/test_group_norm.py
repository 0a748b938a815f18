"""accel.hooks.group_norm on the CPU: which layers are routed, the stock path off the GPU, undo,
and that a CPU pipeline under compile=True keeps its decoder as it is (inductor runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks import group_norm
from accel.hooks.group_norm import compile_group_norms
from pipelines.builders import build_pipeline


class Custom(torch.nn.GroupNorm):
    pass


@torch.no_grad()
def test_only_plain_group_norms_are_routed_and_the_cpu_runs_the_stock_way(monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(group_norm, "_group_norm", lambda: lambda *a: calls.append(1))
    plain, custom, own = torch.nn.GroupNorm(4, 8), Custom(4, 8), torch.nn.GroupNorm(2, 8)
    own_forward = own.forward
    own.forward = own_forward  # a forward of its own (someone else's)
    model = torch.nn.Sequential(plain, custom, own, torch.nn.LayerNorm(5))
    x = torch.randn(2, 8, 5, 5)
    want = model(x)
    undo = compile_group_norms(model, tmp_path)
    try:
        assert [m for m in model.modules() if "forward" in vars(m)] == [plain, own]
        assert vars(own)["forward"] is own_forward
        assert torch.equal(model(x), want) and calls == []  # a CPU tensor: ATen's GroupNorm
    finally:
        undo()
    assert "forward" not in vars(plain) and vars(own)["forward"] is own_forward


def test_the_route_calls_the_compiled_function_for_a_cuda_tensor(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(group_norm, "_group_norm", lambda: lambda *a: seen.append(a[1:]) or a[0])
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    forward = group_norm._forward(norm)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    x = torch.randn(1, 8, 3, 3).as_subclass(FakeCuda)
    with torch.no_grad():
        assert forward(x) is x
    assert seen == [(4, norm.weight, norm.bias, 1e-6)]
    with torch.enable_grad():  # a backward: the stock way (inductor's kernel has none here)
        forward(torch.randn(1, 8, 3, 3))
    assert len(seen) == 1


@pytest.mark.parametrize("compile", [True, False])
def test_a_cpu_pipeline_keeps_its_decoder_norms(compile: bool) -> None:
    pipe = build_pipeline("flux", "tiny")
    accelerate_pipeline(pipe, compile=compile)
    try:
        norms = [m for m in pipe.vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm)]
        assert norms and not any("forward" in vars(m) for m in norms)
    finally:
        pipe.accel.restore()
