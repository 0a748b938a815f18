"""accel.hooks.compiled.group_norm on the CPU: which layers are routed, the stock path off the GPU, undo,
and that a CPU pipeline under compile=True keeps its decoder as it is (inductor runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.compiled import group_norm
from accel.hooks.compiled.group_norm import compile_group_norms
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
        assert torch.equal(forward(x), x)
    assert [(g, w.data_ptr(), b.data_ptr(), eps) for g, w, b, eps in seen] == [
        (4, norm.weight.data_ptr(), norm.bias.data_ptr(), 1e-6)
    ]
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


def test_every_rank_channel_count_and_batch_size_is_one_of_four_compiles() -> None:
    """A decoder normalises (N, C, H, W) in its convolutions and (N, C, HW) in its attention; served
    at batch sizes 8, 4, 2 and 1 these were 8 compiles, and fullgraph turned dynamo's recompile
    limit into an error in the middle of a call (H100, Z-Image, compile=True)."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.functional.group_norm, dynamic=True, fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (8, 4, 2, 1):
            for c, shape in ((32, (6, 5)), (64, (30,)), (32, (3, 4, 2)), (64, (7, 7))):
                norm = torch.nn.GroupNorm(8, c)
                norm.weight.normal_(generator=g), norm.bias.normal_(generator=g)
                x = torch.randn(n, c, *shape, generator=g)
                if len(shape) == 1:  # as a decoder's attention hands it over: a transposed view
                    x = torch.randn(n, *shape, c, generator=g).transpose(1, 2)
                got = group_norm._as_rows(compiled, x, norm)
                assert got.shape == x.shape
                torch.testing.assert_close(got, norm(x), rtol=1e-5, atol=1e-5)
    # A batch of 1 (dynamo specialises sizes of 1) and the transposed layout: 4 at most, whatever
    # the ranks, channel counts, batch sizes and resolutions.
    assert len(graphs) <= 4, f"{len(graphs)} compiles"
    torch._dynamo.reset()
