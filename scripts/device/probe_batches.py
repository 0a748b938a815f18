"""How a denoiser's graphs scale with batch size: per-image seconds of whole pipeline calls at
each batch size, and the warm-up time of each bucket, for choosing bcg-serve's default buckets.

    python3 scripts/device/probe_batches.py --model z-image --resolution 512 --steps 9 \
        --batch-sizes 1 2 4 8 --compile --out out/batches.json

One process, one pipeline; every batch size is warmed up first, then timed in interleaved
rounds (the median per size is kept), so the ratios between sizes are of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="z-image")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--quantize", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    import torch

    from accel import accelerate_pipeline
    from pipelines.builders import build_pipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    pipe = build_pipeline(a.model, a.size, device=device, dtype=dtype, seed=0)
    pipe.set_progress_bar_config(disable=True)
    built = time.perf_counter() - t0
    accelerate_pipeline(pipe, compile=a.compile, quantize=a.quantize)
    res = (a.resolution, a.resolution)
    warm: dict[int, float] = {}
    for k in sorted(a.batch_sizes, reverse=True):
        t = time.perf_counter()
        pipe.accel.warmup(res, batch_sizes=[k], cfg=False, progress=False)
        warm[k] = time.perf_counter() - t

    def call(k: int) -> float:
        torch.cuda.synchronize() if device == "cuda" else None
        t = time.perf_counter()
        pipe(
            prompt=[f"a red fox, number {i}" for i in range(k)],
            width=res[0],
            height=res[1],
            num_inference_steps=a.steps,
            generator=torch.Generator(device).manual_seed(0),
            output_type="pil",
        )
        torch.cuda.synchronize() if device == "cuda" else None
        return time.perf_counter() - t

    times: dict[int, list[float]] = {k: [] for k in a.batch_sizes}
    for k in a.batch_sizes:
        call(k)  # untimed
    for _ in range(a.rounds):
        for k in a.batch_sizes:
            times[k].append(call(k))
    rows = {
        k: {
            "call_s": statistics.median(v),
            "per_image_s": statistics.median(v) / k,
            "images_per_s": k / statistics.median(v),
            "warmup_s": warm[k],
        }
        for k, v in times.items()
    }
    out = {
        "model": a.model,
        "resolution": a.resolution,
        "steps": a.steps,
        "compile": a.compile,
        "quantize": a.quantize,
        "build_s": built,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batches": rows,
        "stats": {k: str(v) for k, v in pipe.accel.stats().items()},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
