"""The per-head RMS norm and rotation (accel/hooks/compiled/head_norm.py) on a GPU: its Triton
kernel against the reference (the modules' arithmetic) at Qwen-Image 2.1's shapes (1024x1024: 4096
image tokens, 32 heads of 128, 69 cached prefix tokens): the prefix copied as it is, few values off
at all and none by more than what one bf16 unit of the normalised pair becomes once rotated (the
norm's sum runs in another order); a plain CUDA graph replays it bit for bit. Prints the kernel's
GPU time beside the compiled reference's, both replayed from CUDA graphs (not asserted)."""

from __future__ import annotations

import pytest
import torch

from accel.hooks.compiled.head_norm import head_norm_rope, head_norm_rope_reference
from tests.helpers.replayed import replayed_us

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
EPS = 1e-6


def _inputs(batch: int, tokens: int, heads: int, prefix: int, strided: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(DEVICE).manual_seed(0)
    d = 128
    wide = torch.randn(batch, tokens, (3 if strided else 1) * heads * d, device=DEVICE, generator=g) * 3 + 0.5
    x = wide.bfloat16()[..., : heads * d].unflatten(-1, (heads, d))
    weight = (torch.randn(d, device=DEVICE, generator=g) * 0.3 + 1).bfloat16()
    angles = torch.rand(tokens, d // 2, device=DEVICE, generator=g) * 6.3
    freqs = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    cached = torch.randn(batch, prefix, heads, d, device=DEVICE, generator=g).bfloat16() if prefix else None
    return x, weight, freqs, cached


@torch.no_grad()
@pytest.mark.parametrize(
    "case", [(1, 4096, 32, 69, False), (1, 4096, 32, 0, True), (2, 4165, 32, 0, False), (3, 7, 2, 5, True)]
)
def test_the_kernel_is_within_a_bf16_unit_of_the_reference(case: tuple) -> None:
    x, weight, freqs, cached = _inputs(*case)
    got = head_norm_rope(x, weight, EPS, freqs, cached)
    want = head_norm_rope_reference(x, weight, EPS, freqs, cached)
    assert got.shape == want.shape and got.dtype == want.dtype
    p = 0 if cached is None else cached.shape[1]
    assert torch.equal(got[:, :p], want[:, :p])
    a, b = got[:, p:].float(), want[:, p:].float()
    differ = (a != b).float().mean().item()
    # The normalised (real, imaginary) pair may be one bf16 unit off in each part; the rotation keeps
    # the pair's length, so the rotated values move by at most one unit of that length, and their
    # own rounding may land one unit of the value apart.
    pair = b.unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True).expand(*b.shape[:-1], b.shape[-1] // 2, 2).flatten(-2)
    bound = (pair + b.abs()) * 2**-7 + 2**-12
    print(f"\n{case}: {differ:.2e} of the values differ, largest {(a - b).abs().max().item():.3e}")
    assert ((a - b).abs() <= bound).all()
    assert differ < 1e-2


@torch.no_grad()
def test_a_cuda_graph_replays_it_bit_for_bit() -> None:
    x, weight, freqs, cached = _inputs(1, 4096, 32, 69, False)
    eager = head_norm_rope(x, weight, EPS, freqs, cached)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_norm_rope(x, weight, EPS, freqs, cached)
    out.fill_(float("nan"))  # poisoned: the replay must write every value
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@torch.no_grad()
def test_time_beside_the_compiled_reference() -> None:
    x, weight, freqs, cached = _inputs(1, 4096, 32, 69, False)
    compiled = torch.compile(head_norm_rope_reference)
    args = (x, weight, EPS, freqs, cached)
    ours, theirs = replayed_us(head_norm_rope, *args), replayed_us(compiled, *args)
    print(f"\nkeys with a 69-token prefix, 4096 x 32 x 128: kernel {ours:.1f} us, compiled reference {theirs:.1f} us")
    assert ours > 0 and theirs > 0
