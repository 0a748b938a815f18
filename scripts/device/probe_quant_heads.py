"""What float8 attention's quantization costs, compiled, at Qwen-Image 2.1's 1024x1024 shape (4096
image queries, 69 prefix keys before 4096 image keys, 32 heads x 128), against what the float8
kernel saves: the library's ``quantize_heads`` of queries, keys (smoothed) and values; another
form of it (the keys' mean as a product, each head's amax in two reductions: measured slower
alone); and the FA3 kernels they feed (bf16, float8). Keys and values are a concatenation of the
cached prefix and the step's keys, as the processor makes them.

    python3 scripts/device/probe_quant_heads.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

QUERIES, PREFIX, HEADS, DIM = 4096, 69, 32, 128


def _two_reductions(x, smooth: bool = False):  # the other form
    import torch

    from accel.hooks.attention import fa3

    b, t, h, d = x.shape
    if smooth:
        weights = x.new_full((b, 1, t), 1.0 / t)
        x = x.float() - torch.matmul(weights, x.reshape(b, t, h * d)).view(b, 1, h, d).float()
    else:
        x = x.float()
    scale = (x.abs().amax(dim=3).amax(dim=1) / fa3.E4M3_MAX).clamp_min(1e-12)
    return (x / scale[:, None, :, None]).to(torch.float8_e4m3fn), scale


def _ms(fn, *args, n: int = 50) -> float:
    import torch

    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> int:
    import torch

    from accel.hooks.attention import fa3

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(t: int, offset: float = 0.0):
        return (torch.randn(1, t, HEADS, DIM, device=dev, generator=g) + offset).bfloat16()

    q, k, v = rnd(QUERIES), rnd(QUERIES, 3.0), rnd(QUERIES)
    pk, pv = rnd(PREFIX, 3.0), rnd(PREFIX)

    def step(quantize):
        def run(q, k, v, pk, pv):
            kc, vc = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
            return quantize(q), quantize(kc, smooth=True), quantize(vc)

        return torch.compile(run, fullgraph=True)

    lib, other = step(fa3.quantize_heads), step(_two_reductions)
    (q8, qs), (k8, ks), (v8, vs) = lib(q, k, v, pk, pv)
    (_, qs0), (_, ks0), (_, vs0) = other(q, k, v, pk, pv)
    assert torch.equal(qs, qs0) and torch.equal(vs, vs0), "the amax of queries and values changed"
    print(f"key scales, other form against the library's: max rel {((ks - ks0).abs() / ks0).max().item():.2e}")
    kc, vc = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
    ref = fa3.fa3_attention(q, kc, vc).float()
    out = fa3._call(q8, k8, v8, None, None, False, (qs, ks, vs)).float()
    print(f"float8 attention rel L2 to bf16 FA3: {((out - ref).norm() / ref.norm()).item():.4f}")
    rows = {
        "quantize q, k, v (quantize_heads)": _ms(lib, q, k, v, pk, pv),
        "quantize q, k, v (the other form)": _ms(other, q, k, v, pk, pv),
        "FA3 bf16 attention": _ms(lambda: fa3.fa3_attention(q, kc, vc)),
        "FA3 float8 attention (kernel only)": _ms(lambda: fa3._call(q8, k8, v8, None, None, False, (qs, ks, vs))),
    }
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | per layer, mean of 50 back to back")
    for name, ms in rows.items():
        print(f"  {name}: {ms * 1000:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
