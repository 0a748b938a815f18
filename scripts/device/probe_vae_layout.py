"""What the decoder's memory layout costs: Qwen-Image 2.1's VAE decode at 1024x1024 (full size,
random weights, bf16) with its convolutions' weights in the stock layout and in channels-last
(cuDNN's native NHWC kernels; the activations follow the weights), each with the stock channel
norms and with them routed through inductor (:mod:`accel.hooks.compiled.channel_norm`, what
``compile=True`` does), and each of those with the causal convolutions' symmetric zero padding
handed to the convolution (cuDNN pads as it reads) instead of ``F.pad``'s copy. Times are CUDA events around the decode, median of 7 after 3 warm-ups;
the distance is to the stock decode's pixels. Nothing here is a library default: it says whether a
layout form is worth building.

    python3 scripts/device/probe_vae_layout.py [--whole-decoder]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit


def in_conv_padding(conv: Any) -> Any:
    """``conv``'s forward (a single-frame causal convolution: squeeze the frame, ``F.pad``, convolve,
    unsqueeze) with its padding handed to the convolution where it is symmetric."""
    import torch.nn.functional as F

    left, right, top, bottom = conv._padding
    if left != right or top != bottom:
        return conv.forward

    def forward(x: Any, cache_x: Any = None) -> Any:
        x = F.conv2d(x.squeeze(2), conv.weight, conv.bias, conv.stride, (top, left), conv.dilation, conv.groups)
        return x.unsqueeze(2)

    return forward


def main(argv: list[str] | None = None) -> None:
    import argparse

    import torch
    from benchkit.measure import Clock

    from accel.hooks.compiled import compile_channel_norms
    from pipelines.builders import build_vae

    parser = argparse.ArgumentParser(description="The decoder's layout, padding and norms, timed on one GPU.")
    parser.add_argument(
        "--whole-decoder",
        action="store_true",
        help="also time the whole decoder through torch.compile (slow to compile)",
    )
    whole = parser.parse_args(argv).whole_decoder
    vae = build_vae("qwen-image-2.1", "full", device="cuda", dtype=torch.bfloat16).eval()
    side = 1024 // 16
    g = torch.Generator("cuda").manual_seed(0)
    z = torch.randn(1, vae.config.z_dim, 1, side, side, device="cuda", generator=g, dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode of {tuple(z.shape)} to 1024x1024")

    def decode() -> torch.Tensor:
        with torch.no_grad():
            return vae.decode(z).sample

    clock = Clock(torch.device("cuda"))
    stock = decode().float()
    convs = [m for m in vae.modules() if type(m).__name__.endswith("CausalConv3d")]
    for routed in (False, True):
        undo = compile_channel_norms(vae) if routed else None
        for in_conv in (False, True):
            for conv in convs:
                if in_conv:
                    conv.forward = in_conv_padding(conv)
                else:
                    vars(conv).pop("forward", None)
            for layout in (torch.contiguous_format, torch.channels_last):
                vae.to(memory_format=layout)
                ms = clock.time_steps(decode, repeats=7, warmup=3)[0]
                out = decode().float()
                rel = ((out - stock).norm() / stock.norm()).item()
                name = (
                    f"{'routed' if routed else 'stock'} norms, "
                    f"{'channels-last' if layout is torch.channels_last else 'stock'} layout, "
                    f"{'in-conv' if in_conv else 'F.pad'} padding"
                )
                print(
                    f"{name}: {ms:.1f} ms, rel L2 to the stock decode {rel:.2e}, "
                    f"max abs {(out - stock).abs().max().item():.3e}"
                )
        for conv in convs:
            vars(conv).pop("forward", None)
        vae.to(memory_format=torch.contiguous_format)
        if undo is not None:
            undo()
    if whole:
        # The whole decoder through inductor (its pads, norms and activations fused around cuDNN's
        # convolutions), in each layout: what compiling more than the norms would add.
        vae.decoder.forward = torch.compile(vae.decoder.forward, dynamic=False)
        for layout in (torch.contiguous_format, torch.channels_last):
            vae.to(memory_format=layout)
            t0 = time.perf_counter()
            decode()
            first = time.perf_counter() - t0
            ms = clock.time_steps(decode, repeats=7, warmup=3)[0]
            out = decode().float()
            rel = ((out - stock).norm() / stock.norm()).item()
            name = f"whole decoder compiled, {'channels-last' if layout is torch.channels_last else 'stock'} layout"
            print(f"{name}: {ms:.1f} ms (first call {first:.1f} s), rel L2 to the stock decode {rel:.2e}")
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"peak {peak:.1f} GiB")


if __name__ == "__main__":
    main()
