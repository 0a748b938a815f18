"""The VAE's channel RMS norms through inductor (accel/hooks/compiled/channel_norm.py) on a GPU: the
full-size Qwen-Image 2.1 decoder (random weights, bf16) decoding a 1024x1024 latent with the route
near the stock decode (inductor keeps float32 between the code's casts), and a CUDA graph of the
routed decode replaying it bit for bit. Prints both decodes' times (not asserted)."""

from __future__ import annotations

import pytest
import torch

from accel.hooks.compiled.channel_norm import compile_channel_norms, is_channel_rms_norm
from pipelines.families.qwen_image_21.release import VAE

pytestmark = pytest.mark.cuda


def _ms(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def test_the_routed_decoder_is_near_the_stock_one_and_replays_bit_for_bit(tmp_path) -> None:
    torch.manual_seed(0)
    vae = VAE.cls(**VAE.configs["full"]).to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, vae.config.z_dim, 1, 64, 64, device="cuda", dtype=torch.bfloat16)

    def decode() -> torch.Tensor:
        return vae.decode(z, return_dict=False)[0]

    norms = sum(is_channel_rms_norm(m) for m in vae.decoder.modules())
    stock = decode()
    stock_ms = _ms(decode)
    undo = compile_channel_norms(vae.decoder, tmp_path)
    assert undo is not None
    try:
        routed = decode()
        routed_ms = _ms(decode)
        rel = ((routed.float() - stock.float()).norm() / stock.float().norm()).item()
        print(
            f"\n{norms} norms; decode 1024x1024: stock {stock_ms:.1f} ms, routed {routed_ms:.1f} ms; rel L2 {rel:.2e}"
        )
        assert torch.isfinite(routed).all() and rel < 2e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode()
        out.fill_(float("nan"))  # poisoned: the replay must write every value
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, routed)
    finally:
        undo()
    assert torch.equal(decode(), stock)
