"""The VAE decode of scripts/bench_vae.py: eager and under the library's graph, contiguous and
channels-last, each timed by CUDA events and compared with the first eager output."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from .environment import collect_env
from .settings import parse_resolution, say


def _timed(fn: Any, repeats: int, warmup: int) -> tuple[float, Any]:
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def _top_kernels(fn: Any, n: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.device_time / 1000
            t[1] += 1
    rows = sorted(((k, round(v[0], 3), int(v[1])) for k, v in totals.items()), key=lambda r: -r[1])
    return rows[:n]


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="z-image")
    p.add_argument("--resolution", type=parse_resolution, default=(1024, 1024))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--top", type=int, default=0, help="list the N costliest kernels of each variant")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """The decode's variants: vae.json under ``--out``."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_vae.py measures on a CUDA device")

    from accel import accelerate_pipeline
    from pipelines.builders import build_pipeline

    device = torch.device("cuda")
    env = collect_env(device)
    pipe = build_pipeline(args.model, "full", device, torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe)
    w, h = args.resolution
    pipe.accel.warmup([(w, h)], cfg=False, progress=False)
    runner = pipe.accel.runners["vae.decoder"]
    vae = pipe.vae
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (1, vae.config.latent_channels, h // factor, w // factor)
    latents = torch.randn(shape, device=device, dtype=vae.dtype, generator=torch.Generator(device).manual_seed(0))

    def decode() -> torch.Tensor:
        with torch.no_grad():
            return vae.decode(latents, return_dict=False)[0]

    rows: list[dict[str, Any]] = []
    ref: torch.Tensor | None = None
    for layout in ("contiguous", "channels_last"):
        if layout == "channels_last":
            vae.to(memory_format=torch.channels_last)
            pipe.accel.warmup([(w, h)], cfg=False, progress=False)  # weights moved: captured again
        for graphs in (False, True):
            runner.enabled = graphs
            before = runner.stats(memory=False).replays
            ms, out = _timed(decode, args.repeats, 3)
            replays = runner.stats(memory=False).replays - before
            ref = out.clone() if ref is None else ref
            row = dict(
                layout=layout,
                graphs=graphs,
                ms=round(ms, 2),
                replays=replays,
                equal_to_eager=bool(torch.equal(out, ref)),
                max_abs_diff=float((out.float() - ref.float()).abs().max()),
            )
            if args.top:
                row["top"] = _top_kernels(decode, args.top)
            rows.append(row)
            say(f"{args.model} {w}x{h} VAE decode, {layout}, graphs {graphs}: {ms:.2f} ms ({replays} replays)")
    runner.enabled = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(env=env, model=args.model, resolution=[w, h], latents=list(shape), rows=rows)
    (out_dir / "vae.json").write_text(json.dumps(result, indent=1))
    say(f"wrote {out_dir / 'vae.json'}")
    return 0
