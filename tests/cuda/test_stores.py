"""Calls that fill the containers they are given, under real CUDA graphs (accel.graphs.stores).

* The toy causal decoder (tests/graphs/causal_toy.py) decodes frame by frame, each call reading
  what the one before stored; two widths share one pool, the wider captured first, so the
  narrower's captures reuse the memory of the wider's stored tensors (held as non-owning views).
  Videos are decoded in turns, in shuffled order, with allocator churn between calls: every frame
  and every cache equals the same module run eagerly, bit for bit.
* Qwen-Image's full-size VAE (bf16, random weights) decodes through its decoder's graphs at two
  resolutions, in shuffled order with churn, bit-equal to the stock decode, and its feature cache
  holds the replay's copies until ``clear_cache`` drops them.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from accel.graphs.pool import GraphPool
from accel.graphs.runner import GraphRunner
from tests.graphs.causal_toy import ToyCausalDecoder, decode

pytestmark = pytest.mark.cuda


def _churn() -> None:
    # Allocations of odd sizes between calls, so a replay that read freed memory would show it.
    junk = [torch.randn(n, device="cuda") for n in (1 << 18, 3 << 16, 5 << 14)]
    del junk


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@torch.no_grad()
def test_toy_causal_decoder_in_turns_and_shuffled_equals_eager() -> None:
    dec = ToyCausalDecoder(channels=8).cuda()
    runner = GraphRunner(dec.forward, name="toy-decoder", pool=GraphPool("cuda"))
    frames = 4
    with runner.capturing():
        for width in (96, 32):  # the wider first: the narrower's graphs reuse its freed blocks
            z = torch.randn(1, 8, frames, width, device="cuda")
            got, cache = decode(runner, z, dec.slots)
            want, want_cache = decode(dec, z, dec.slots)
            assert _same(got, want) and _same(cache, want_cache), width
    st = runner.stats()
    assert st.captures == 6 and not runner.blocked and st.stored_bytes > 0, runner.blocked

    g = torch.Generator("cuda").manual_seed(0)
    videos = [torch.randn(1, 8, frames, w, device="cuda", generator=g) for w in (32, 96, 32, 96, 96, 32)]
    random.Random(0).shuffle(videos)
    caches: list[list[Any]] = [[None] * dec.slots for _ in videos]
    want_caches: list[list[Any]] = [[None] * dec.slots for _ in videos]
    for f in range(frames):
        for z, cache, want_cache in zip(videos, caches, want_caches):
            x = z[:, :, f : f + 1].contiguous()
            _churn()
            got = runner(x, feat_cache=cache, feat_idx=[0])
            want = dec(x, feat_cache=want_cache, feat_idx=[0])
            assert _same(got, want) and _same(cache, want_cache), (f, z.shape)
    after = runner.stats()
    assert after.eager_calls == 0 and after.captures == 6
    assert after.replays - st.replays == frames * len(videos)


@torch.no_grad()
def test_qwen_image_vae_decodes_through_its_graphs_bit_equal() -> None:
    from pipelines.builders import build_vae

    vae = build_vae("qwen-image", "full", device="cuda", dtype=torch.bfloat16)
    sizes = [(1024, 1024), (768, 512)]  # (width, height)
    g = torch.Generator("cuda").manual_seed(0)
    latents = {
        wh: torch.randn(
            1, vae.config.z_dim, 1, wh[1] // 8, wh[0] // 8, device="cuda", dtype=torch.bfloat16, generator=g
        )
        for wh in sizes
    }
    want = {wh: vae.decode(z, return_dict=False)[0] for wh, z in latents.items()}
    stock = vae.decoder.forward
    runner = GraphRunner(stock, name="vae.decoder", pool=GraphPool("cuda"))
    vae.decoder.forward = runner
    try:
        with runner.capturing():
            for wh in sizes:
                assert torch.equal(vae.decode(latents[wh], return_dict=False)[0], want[wh]), wh
        st = runner.stats()
        assert st.entries == len(sizes) and not runner.blocked, runner.blocked
        print(f"\nqwen-image VAE decoder: {st.stored_bytes / 2**20:.1f} MiB copied out per replay of both sizes")
        order = sizes * 3
        random.Random(1).shuffle(order)
        for wh in order:
            _churn()
            assert torch.equal(vae.decode(latents[wh], return_dict=False)[0], want[wh]), wh
            assert vae._feat_map == [None] * vae._conv_num  # clear_cache dropped the copies
        after = runner.stats()
        assert after.replays - st.replays == len(order) and after.eager_calls == 0
    finally:
        vae.decoder.forward = stock
