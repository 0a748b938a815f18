"""A residual's gated update in one op (accel/hooks/compiled/gated_residual.py) on a GPU: its Triton
kernel gives the tensor ops' bits at Qwen-Image 2.1's shapes (1024x1024: 4096 image tokens of 4096
channels, the target-token mask, two samples), a plain CUDA graph replays it bit for bit, and its
time prints beside the compiled reference's, both replayed from CUDA graphs (not asserted)."""

from __future__ import annotations

import pytest
import torch

from accel.hooks.compiled.gated_residual import gated_residual, gated_residual_reference
from tests.helpers.replayed import replayed_us

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


def _inputs(batch: int, tokens: int, d: int, masked: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(DEVICE).manual_seed(0)
    hidden = (torch.randn(batch, tokens, d, device=DEVICE, generator=g) * 4).bfloat16()
    out = (torch.randn(batch, tokens, d, device=DEVICE, generator=g) * 2 + 0.3).bfloat16()
    gate = (torch.randn(batch + masked, d, device=DEVICE, generator=g) * 1.5).bfloat16()
    mask = (torch.arange(tokens, device=DEVICE) % 5 != 0) if masked else None
    return hidden, out, gate, mask


@torch.no_grad()
@pytest.mark.parametrize("case", [(1, 4096, 4096, True), (2, 4165, 4096, True), (3, 77, 3072, False), (2, 9, 64, True)])
def test_the_kernel_gives_the_tensor_ops_bits(case: tuple) -> None:
    hidden, out, gate, mask = _inputs(*case)
    assert torch.equal(gated_residual(hidden, out, gate, mask), gated_residual_reference(hidden, out, gate, mask))


@torch.no_grad()
def test_a_cuda_graph_replays_it_bit_for_bit() -> None:
    hidden, out, gate, mask = _inputs(1, 4096, 4096, True)
    eager = gated_residual(hidden, out, gate, mask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = gated_residual(hidden, out, gate, mask)
    result.fill_(float("nan"))  # poisoned: the replay must write every value
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result, eager)


@torch.no_grad()
def test_time_beside_the_compiled_reference() -> None:
    hidden, out, gate, mask = _inputs(1, 4096, 4096, True)
    compiled = torch.compile(gated_residual_reference)
    args = (hidden, out, gate, mask)
    ours, theirs = replayed_us(gated_residual, *args), replayed_us(compiled, *args)
    print(f"\n4096 x 4096 with the mask: op {ours:.1f} us, compiled reference {theirs:.1f} us")
    assert ours > 0 and theirs > 0
