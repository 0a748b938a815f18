"""What copying a request's K/V cache into a graph's static inputs costs: the copy a cached step's
replay makes when the branch's cache is not in place already (true CFG: cond and uncond caches
alternate on one graph, so every step copies its branch's cache in; without CFG once per call).

    python3 scripts/device/probe_state_copy.py --out out/state_copy.json

For each model: the bytes of one branch's cache (every layer's K and V of the prefix, bf16) and
the milliseconds of copying them all (kernel time, from a CUDA graph of back-to-back copies), and
the same through a :class:`accel.graphs.runner.GraphRunner` over a forward that reads the cache:
one replay whose cache is in place against one that copies it in (median of rounds, CUDA events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (layers, heads, head_dim, prefix tokens): Qwen-Image 2.1 at 1024x1024 with one 1024x1024
# condition image (its 64x64 latent tokens and ~256 of text); FLUX.2 klein 9B KV with a 1024x1024
# reference image (64x64 tokens after 2x2 packing) in its 8 double- and 24 single-stream blocks.
MODELS = {
    "qwen-image-2.1": (32, 32, 128, 4096 + 256),
    "flux2-klein-9b-kv": (32, 32, 128, 4096),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    import torch

    from accel import GraphPool, GraphRunner
    from scripts.device.graph_timing import graph_ms

    class LayerCache:
        def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k, self.v = k, v

    class Cache:
        def __init__(self, layers: list[LayerCache]) -> None:
            self.layers = layers

    def make(layers: int, heads: int, dim: int, tokens: int, seed: int) -> Cache:
        g = torch.Generator("cuda").manual_seed(seed)
        shape = (1, tokens, heads, dim)
        return Cache(
            [
                LayerCache(*(torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)))
                for _ in range(layers)
            ]
        )

    def read(x: torch.Tensor, kv_cache: Cache) -> torch.Tensor:
        # A forward that reads every layer's cache once, as the cached steps' attention does.
        for layer in kv_cache.layers:
            x = x + layer.k[:, :1, 0, :1].float().sum() + layer.v[:, :1, 0, :1].float().sum()
        return x

    def replay_ms(runner: GraphRunner, x: torch.Tensor, caches: list[Cache]) -> float:
        times = []
        for i in range(a.rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner(x, kv_cache=caches[i % len(caches)])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    for name in a.models:
        layers, heads, dim, tokens = MODELS[name]
        cond, uncond = make(layers, heads, dim, tokens, 0), make(layers, heads, dim, tokens, 1)
        static = make(layers, heads, dim, tokens, 2)
        pairs = [(s, c) for sl, cl in zip(static.layers, cond.layers) for s, c in ((sl.k, cl.k), (sl.v, cl.v))]
        nbytes = sum(c.numel() * c.element_size() for _, c in pairs)

        def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs) -> None:
            for s, c in pairs:
                s.copy_(c)

        runner = GraphRunner(read, name=name, pool=GraphPool("cuda"))
        runner.state_types = frozenset({Cache})
        x = torch.zeros(1, device="cuda")
        assert runner.capture(x, kv_cache=cond), runner.blocked
        in_place = replay_ms(runner, x, [cond])  # the cache found in place: no copy (no CFG)
        alternating = replay_ms(runner, x, [cond, uncond])  # true CFG: each replay copies its cache in
        results["models"][name] = {
            "layers": layers,
            "prefix_tokens": tokens,
            "cache_bytes_per_branch": nbytes,
            "copy_ms": round(graph_ms(copy_all, reps=5, rounds=10), 3),
            "replay_ms_cache_in_place": round(in_place, 3),
            "replay_ms_caches_alternating": round(alternating, 3),
        }
        print(name, json.dumps(results["models"][name]), flush=True)
        pairs.clear()
        del runner, cond, uncond, static, copy_all
        torch.cuda.empty_cache()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
