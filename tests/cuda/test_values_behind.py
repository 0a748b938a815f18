"""A float8 product written behind a copied prefix (accel/hooks/fp8/scaled_mm.py,
``scaled_mm_rowwise_behind``) on a GPU: at Qwen-Image 2.1's value projection (1024x1024: 4096
image tokens, 4096 channels in and out, a cached prefix of text tokens, or of text and a condition
image's) it is the concatenation of the prefix and the same product bit for bit, a plain CUDA graph
replays it bit for bit, and its time prints beside the product and the concatenation it stands
for, all replayed from CUDA graphs (not asserted)."""

from __future__ import annotations

import pytest
import torch

from accel.hooks.fp8.scaled_mm import quantize_rows, scaled_mm_rowwise, scaled_mm_rowwise_behind
from tests.helpers.replayed import replayed_us

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


def _inputs(tokens: int, p: int) -> tuple[torch.Tensor, ...]:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 products need compute capability 8.9 or newer")
    g = torch.Generator(DEVICE).manual_seed(p)
    x = torch.randn(tokens, 4096, device=DEVICE, generator=g).bfloat16()
    w = (torch.randn(4096, 4096, device=DEVICE, generator=g) / 64).bfloat16()
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    bias = torch.randn(4096, device=DEVICE, generator=g).bfloat16()
    prefix = torch.randn(p, 4096, device=DEVICE, generator=g).bfloat16()
    return xq, wq.t(), xs, ws.reshape(1, -1), bias, prefix


@torch.no_grad()
@pytest.mark.parametrize(("tokens", "p"), [(4096, 69), (4096, 4165), (1024, 1), (4096, 0)])
def test_it_is_the_prefix_then_the_same_product(tokens: int, p: int) -> None:
    *args, prefix = _inputs(tokens, p)
    want = torch.cat([prefix, scaled_mm_rowwise(*args, torch.bfloat16)])
    assert torch.equal(scaled_mm_rowwise_behind(*args, prefix), want)


@torch.no_grad()
def test_a_cuda_graph_replays_it_bit_for_bit() -> None:
    args = _inputs(4096, 69)
    eager = scaled_mm_rowwise_behind(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = scaled_mm_rowwise_behind(*args)
    result.fill_(float("nan"))  # poisoned: the replay must write every value
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result, eager)


@torch.no_grad()
def test_time_beside_the_product_and_its_concatenation() -> None:
    *args, prefix = _inputs(4096, 69)
    behind = replayed_us(scaled_mm_rowwise_behind, *args, prefix)
    product = replayed_us(scaled_mm_rowwise, *args, torch.bfloat16)
    both = replayed_us(lambda *a: torch.cat([prefix, scaled_mm_rowwise(*a, torch.bfloat16)]), *args)
    print(
        f"\n4096 tokens behind 69: op {behind:.1f} us, the product alone {product:.1f} us, with the cat {both:.1f} us"
    )
    assert behind > 0 and product > 0 and both > 0
