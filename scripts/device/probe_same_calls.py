"""Whether a compiled full-size Qwen-Image block quantizes its attention input once: one
``QwenImageTransformerBlock`` (3072 wide, random bf16 weights) with the library's float8 layers,
compiled as the library compiles blocks, its one-pass quantizations counted per call.

    python3 scripts/device/probe_same_calls.py
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock

    from accel.hooks.compiled import compile_options, fuse_gelu_epilogues
    from accel.hooks.fp8 import ScaledMMFloat8, row_quant

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("accel.hooks.compiled.same_calls").setLevel(logging.DEBUG)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blk = QwenImageTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128).to(dev, torch.bfloat16)
    names = [
        n
        for n, m in blk.named_modules()
        if isinstance(m, torch.nn.Linear) and ("img_mlp" in n or n.startswith("attn.to_"))
    ]
    print("quantized", ScaledMMFloat8().quantize(blk, names))
    fuse_gelu_epilogues(blk)
    counted: list[int] = []
    one_pass = row_quant._one_pass
    row_quant._one_pass = lambda x: counted.append(1) or one_pass(x)
    rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    with torch.no_grad():
        for tokens in (4096, 1024):
            h = torch.randn(1, tokens, 3072, device=dev, dtype=torch.bfloat16)
            e = torch.randn(1, 66, 3072, device=dev, dtype=torch.bfloat16)
            mask = torch.ones(1, 66, dtype=torch.bool, device=dev)
            temb = torch.randn(1, 3072, device=dev, dtype=torch.bfloat16)
            side = int(tokens**0.5)
            freqs = rope([(1, side, side)], max_txt_seq_len=66, device=dev)
            counted.clear()
            blk(h, e, mask, temb, freqs)
            print(tokens, "eager: quantizations per call", len(counted))
            compiled = torch.compile(blk, **compile_options())
            compiled(h, e, mask, temb, freqs)
            counted.clear()
            compiled(h, e, mask, temb, freqs)
            print(tokens, "compiled: quantizations per call", len(counted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
