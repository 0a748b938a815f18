#!/usr/bin/env python
"""bcg-serve's throughput and latency against the pipeline's own single-call rate, in one process.

Takes bcg-serve's flags (the model's: ``--model``, ``--size``, ``--compile``, ``--quantize``,
``--cache ...``, ``--lora NAME=FILE``, ...; the server's: ``--resolutions`` (the first is
measured), ``--batch-sizes``, ``--max-wait-ms``, ...), builds and warms the pipeline once the way
bcg-serve does (its warm-up time per bucket reported), then, on that pipeline:

* ``pipeline``: the pipeline's own call, one image at a time, at the same settings (the rate to
  beat);
* ``bucket``: one call of each batch-size bucket through the server's engine;
* ``loop``: one request after another through the engine (PNGs, no HTTP);
* ``batched`` (the buckets) and ``unbatched`` (calls of one image, the same server at
  ``--batch-sizes 1``): a real server on a loopback port, with each ``--clients`` count sending
  its share of ``--requests`` requests one after another over HTTP. Each such run also splits a
  request's mean latency, from the server's ``/metrics`` scraped before and after it: queue wait,
  device (its batch's pipeline call), encode (files and base64) and the rest (HTTP, JSON, client).
* ``continuous``: the same server with ``--batching continuous`` (running batches that requests
  join at step boundaries), over the same warm engine and graphs.
* ``--arrival-rate R ...``: after the closed-loop runs, each of ``batched`` and ``continuous``
  (those picked) also serves open-loop arrivals: requests sent at Poisson times of ``R`` a second
  (at most ``--requests`` of them and ``--arrival-seconds`` of sending; loopback only), whatever
  the answers, with p50/p95/p99 latency and images/s side by side. ``0.7x`` is 0.7 times the
  images/s the ``batched`` server made at its largest ``--clients`` count in this process (its
  measured maximum).

``--variants`` picks among them (default all). With ``--lora``, every request names the first
adapter. Speed is measured, never asserted: only ratios within one run count (serve.md lists
them: the server over the pipeline's rate, batched over unbatched, the one-client p50 over the
pipeline call's). The median of ``--repeats`` interleaved runs is kept. Writes ``serve.json``
and ``serve.md`` to ``--out`` after every run, so a run cut short keeps what it measured; with
``--quantize`` both state what it did (layers in float8 and in bf16, the latents' distance, the
call measured).

    python scripts/bench_serve.py --resolutions 64x64 --steps 2 --out outputs/bench-serve
    python scripts/bench_serve.py --model z-image --size full --resolutions 512x512 --steps 9 --compile \\
        --batch-sizes 1 2 4 8 --clients 1 16 --requests 64 --repeats 1 --out out/serve   # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchkit.settings import say

VARIANTS = ("pipeline", "bucket", "loop", "batched", "unbatched", "continuous")


def arrival_rate(text: str) -> tuple[float, bool]:
    """``R`` (requests a second) or ``Fx`` (a fraction of the batched server's measured maximum):
    (the number, whether it is a fraction)."""
    fraction = text.endswith("x")
    try:
        value = float(text[:-1] if fraction else text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: requests a second (3.2) or a fraction of the batched maximum (0.7x)"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value, fraction


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The bench's own flags, and the rest (bcg-serve's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Every other flag is bcg-serve's.")
    p.add_argument("--steps", type=int, default=2, help="denoising steps of every request (default 2)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients, a run each")
    p.add_argument("--requests", type=int, default=64, help="requests per run, spread over its clients (default 64)")
    p.add_argument("--pipeline-calls", type=int, default=8, help="single calls timed for the pipeline's rate")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved; the median is kept")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help=f"what to run (default all: {' '.join(VARIANTS)})")  # fmt: skip
    p.add_argument("--arrival-rate", type=arrival_rate, nargs="+", default=[], metavar="R",
                   help="open-loop runs at Poisson arrivals of R requests a second, or Fx: F times the batched "
                   "server's measured images/s at its largest --clients (batched and continuous, those picked)")  # fmt: skip
    p.add_argument("--arrival-seconds", type=float, default=60.0,
                   help="the most seconds an open-loop run sends for (default 60; --requests bounds it too)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="folder for serve.json and serve.md")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, serve_flags = parse(argv)
    from pipelines.generation.errors import GenerationError
    from pipelines.serve.config import UsageError, parse_args

    try:
        config = parse_args(serve_flags)
    except UsageError as e:
        sys.stderr.write(f"bench_serve.py: error: {e}\n")
        return 2
    import torch
    from benchkit.environment import collect_env
    from benchkit.serve_report import markdown, median_rows, ratios, warmup_rows
    from benchkit.serve_runs import Load, Settings, bucket_rates, loop, pipeline_rate, served

    from pipelines.generation.record import quantized
    from pipelines.serve.startup import check, starter

    w, h = config.resolutions[0]
    buckets = " ".join(map(str, config.batch_sizes))
    say(f"building and warming up ({' '.join(serve_flags) or 'the defaults'}): {w}x{h}, batch sizes {buckets}")
    t0 = time.perf_counter()
    try:
        engine = starter(config, *check(config))()
    except GenerationError as e:  # a bad flag (2) or a failed build or warm-up (1), as bcg-serve says them
        sys.stderr.write(f"bench_serve.py: error: {e}\n")
        return e.status
    start_seconds = time.perf_counter() - t0
    names = engine.adapters.names()
    s = Settings(w, h, args.steps, names[0] if names else None)
    env = collect_env(engine.device if isinstance(engine.device, torch.device) else torch.device("cpu"))
    settings = dict(argv=" ".join(sys.argv[1:] if argv is None else argv), resolution=f"{w}x{h}", steps=args.steps,
                    batch_sizes=config.batch_sizes, max_wait_ms=round(config.max_wait * 1000), clients=args.clients,
                    requests=args.requests, repeats=args.repeats, variants=args.variants, lora=s.lora)  # fmt: skip
    # What --quantize did (its selection, measured at the first warm-up), so a run shows whether the
    # served calls had float8 layers at all: None where nothing is quantized.
    quantize = quantized(engine.pipe)
    measured = getattr(getattr(vars(engine.pipe).get("accel"), "quantization", None), "where", None)
    if measured:
        quantize += f"; measured at {measured}"
    if quantize:
        say(f"quantize: {quantize}")
    runs: list[dict[str, Any]] = []

    def save() -> str:
        """serve.json and serve.md as they stand: written after every run, so a run cut short
        (a device's time limit) still leaves what it measured."""
        rows, warm = median_rows(runs), warmup_rows(engine)
        result = dict(env=env, settings=settings, build_seconds=round(start_seconds - engine.warmup_seconds, 2),
                      warmup_seconds=round(engine.warmup_seconds, 2), quantize=quantize, warmup=warm, rows=rows,
                      ratios=ratios(rows), runs=runs)  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
        md = markdown(rows, warm, result)
        if quantize is not None:  # under the title line
            title, _, rest = md.partition("\n\n")
            md = f"{title}\n\nquantize: {quantize}\n\n{rest}"
        (args.out / "serve.md").write_text(md)
        return md

    save()
    if "bucket" in args.variants:  # also meets every bucket's shapes once before the timed runs
        runs += bucket_rates(engine, s)
        for r in runs:
            say(f"   bucket {r['batch']:>2}: {r['images_per_s']:.2f} images/s ({r['seconds']:.3f} s a call)")
        save()
    for repeat in range(args.repeats):
        say(f"repeat {repeat + 1}/{args.repeats}")
        for variant, run in (("pipeline", lambda: pipeline_rate(engine, s, args.pipeline_calls)),
                             ("loop", lambda: loop(engine, s, args.requests))):  # fmt: skip
            if variant in args.variants:
                runs.append(run())
                r = runs[-1]
                say(f"{variant:>9}  1 client   : {r['images_per_s']:.2f} images/s, p50 {r['p50_ms']:.0f} ms")
                save()
        closed = Load(args.clients, args.requests)
        for variant, max_batch, batching in (("batched", config.max_batch, "dynamic"), ("unbatched", 1, "dynamic"),
                                             ("continuous", config.max_batch, "continuous")):  # fmt: skip
            if variant in args.variants:
                runs += served(engine, s, max_batch, config.max_wait, closed, variant, say, batching)
                save()
        if args.arrival_rate:
            rates = open_rates(args.arrival_rate, runs)
            settings["arrival_rates"] = rates
            for variant, batching in (("batched", "dynamic"), ("continuous", "continuous")):
                if variant in args.variants:
                    load = Load((), args.requests, rates, args.arrival_seconds)
                    runs += served(engine, s, config.max_batch, config.max_wait, load, variant, say, batching)
                    save()
    print(save())
    return 0


def open_rates(asked: list[tuple[float, bool]], runs: list[dict[str, Any]]) -> list[float]:
    """The open-loop rates, each fraction (``0.7x``) of the batched server's images/s at its
    largest client count so far."""
    closed = [r for r in runs if r["variant"] == "batched" and r.get("arrival_rate") is None]
    if any(fraction for _, fraction in asked) and not closed:
        raise SystemExit("bench_serve.py: error: --arrival-rate Fx needs the batched variant's closed-loop run")
    top = max(closed, key=lambda r: (r["clients"], r["images_per_s"]))["images_per_s"] if closed else 0.0
    return [round(value * top, 3) if fraction else value for value, fraction in asked]


if __name__ == "__main__":
    sys.exit(main())
