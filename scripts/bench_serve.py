#!/usr/bin/env python
"""bcg-serve's throughput and latency, batching on and off, beside a plain loop, in one process.

Builds and warms the pipeline once, the way ``bcg-serve`` does (its model flags pass through:
``--model``, ``--size``, ``--device``, ...). Then, on that pipeline:

* ``loop``: one request after another through the server's engine, no HTTP: the same pipeline
  calls and PNGs the server makes, back to back;
* ``batched`` (``--max-batch``, ``--max-wait-ms``) and ``unbatched`` (``--max-batch 1``): a real
  server on a loopback port (uvicorn in a thread), with 1, 4 and 16 clients (``--clients``) each
  sending its share of ``--requests`` requests one after another over HTTP.

Per run: images/s, p50/p95 latency (arrival to answer, as the client sees it) and the mean
number of requests per pipeline call, the median of ``--repeats`` interleaved runs. Speed is
measured here, never asserted: only ratios within one run count. Writes ``serve.json`` and ``serve.md`` to ``--out``.

    python scripts/bench_serve.py --resolution 64 --steps 2 --out outputs/bench-serve
    python scripts/bench_serve.py --model z-image --size full --resolution 512 --steps 9 --out out/serve  # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchkit.settings import parse_resolution, say  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(variant: str, clients: int, seconds: float, latencies: list[float], calls: float) -> dict[str, Any]:
    return dict(variant=variant, clients=clients, requests=len(latencies), seconds=round(seconds, 4),
                images_per_s=round(len(latencies) / seconds, 3), p50_ms=round(1000 * _percentile(latencies, 0.5), 2),
                p95_ms=round(1000 * _percentile(latencies, 0.95), 2),
                requests_per_call=round(len(latencies) / calls, 3) if calls else None)  # fmt: skip


def _body(i: int, size: str, steps: int) -> dict[str, Any]:
    return {"prompt": f"a red fox in the snow, take {i}", "seed": i, "size": size, "steps": steps}


def loop(engine: Any, requests: int, size: tuple[int, int], steps: int) -> dict[str, Any]:
    """One request after another through the engine: the pipeline calls and PNGs, no server.

    On a thread of its own, as the server's device worker: on a CPU, torch's OpenMP threads run
    differently from the main thread (on a loaded machine, 10x slower there), and the loop must
    run as the server does.
    """
    from pipelines.serve.schema import ImageRequest

    latencies: list[float] = []
    took: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        for i in range(requests):
            b = _body(i, "", steps)
            start = time.perf_counter()
            engine.run([engine.plan(ImageRequest(b["prompt"], 1, size[0], size[1], seed=i, steps=steps))])
            latencies.append(time.perf_counter() - start)
        took.append(time.perf_counter() - t0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return _row("loop", 1, took[0], latencies, requests)


def served(engine: Any, size: tuple[int, int], steps: int, max_batch: int, max_wait: float,
           clients: list[int], requests: int, variant: str) -> list[dict[str, Any]]:  # fmt: skip
    """A real server on a free loopback port over ``engine``, and a client run per count."""
    import httpx
    import uvicorn

    from pipelines.serve.app import create_app
    from pipelines.serve.batcher import Batcher
    from pipelines.serve.schema import Served
    from pipelines.serve.service import Service

    service = Service(Served("bench", (size,), max_batch), Batcher(max(64, 2 * max(clients)), max_batch, max_wait),
                      lambda: engine, timeout=600)  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="off"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    service.start()
    thread.start()
    while not server.started or service.phase != "ready":
        if not thread.is_alive() or service.phase == "failed":
            raise RuntimeError(f"the server did not start ({service.fatal})")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    name = f"{size[0]}x{size[1]}"
    rows = []
    try:
        for count in clients:
            calls_before = service.worker.batches
            latencies: list[float] = []

            async def client(who: int, c: httpx.AsyncClient, count: int = count, out: list[float] = latencies) -> None:
                for i in range(who, requests, count):
                    start = time.perf_counter()
                    r = await c.post("/v1/images/generations", json=_body(i, name, steps))
                    if r.status_code != 200:
                        raise RuntimeError(f"request {i}: {r.status_code} {r.text}")
                    out.append(time.perf_counter() - start)

            async def run(count: int = count) -> None:
                limits = httpx.Limits(max_connections=count)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as c:
                    await asyncio.gather(*(client(k, c) for k in range(count)))

            t0 = time.perf_counter()
            asyncio.run(run())
            seconds = time.perf_counter() - t0
            rows.append(_row(variant, count, seconds, latencies, service.worker.batches - calls_before))
            say(f"{variant:>9} {count:>2} client(s): {rows[-1]['images_per_s']:.2f} images/s, "
                f"p50 {rows[-1]['p50_ms']:.0f} ms, p95 {rows[-1]['p95_ms']:.0f} ms, "
                f"{rows[-1]['requests_per_call']} requests a call")  # fmt: skip
    finally:
        service.stop()
        server.should_exit = True
        thread.join(60)
        service.worker.join(60)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | clients | images/s | p50 ms | p95 ms | requests a call |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['clients']} | {r['images_per_s']:.2f} | {r['p50_ms']:.0f} | "
                     f"{r['p95_ms']:.0f} | {r['requests_per_call']} |")  # fmt: skip
    by = {(r["variant"], r["clients"]): r["images_per_s"] for r in rows}
    ratios = [f"{c} client(s) {by[('batched', c)] / by[('unbatched', c)]:.2f}x" for v, c in by
              if v == "batched" and ("unbatched", c) in by]  # fmt: skip
    if ratios:
        lines += ["", "batched / unbatched images/s: " + ", ".join(ratios)]
    return "\n".join(lines)


def settle(engine: Any, size: tuple[int, int], steps: int, max_batch: int) -> None:
    """Every batch size a few times first: a CPU captures no graphs, and the first calls at a new
    shape pay for allocations and kernel setup that the timed runs must not."""
    from pipelines.serve.schema import ImageRequest

    def run() -> None:
        for n in range(1, max_batch + 1):
            for _ in range(3):
                engine.run([engine.plan(ImageRequest("settle", n, size[0], size[1], seed=0, steps=steps))])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, clients), the repeat with the median images/s."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["clients"]), []).append(r)
    out = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r["images_per_s"])
        out.append(dict(runs[len(runs) // 2], repeats=len(runs), images_per_s_all=[r["images_per_s"] for r in runs]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resolution", type=parse_resolution, default=(64, 64))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-wait-ms", type=int, default=20)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per run (spread over its clients)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved; the median is kept")
    p.add_argument("--out", type=Path, required=True)
    args, model_flags = p.parse_known_args(argv)

    import torch
    from benchkit.environment import collect_env

    from pipelines.serve.config import parse_args
    from pipelines.serve.startup import check, starter

    w, h = args.resolution
    config = parse_args([*model_flags, "--resolutions", f"{w}x{h}", "--max-batch", str(args.max_batch)])
    say(f"building and warming up ({' '.join(model_flags) or 'the defaults'}), {w}x{h}, batch sizes 1-{args.max_batch}")
    engine = starter(config, *check(config))()
    env = collect_env(engine.device if isinstance(engine.device, torch.device) else torch.device("cpu"))
    settle(engine, (w, h), args.steps, args.max_batch)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        say(f"repeat {repeat + 1}/{args.repeats}")
        runs.append(loop(engine, args.requests, (w, h), args.steps))
        say(f"     loop  1 client   : {runs[-1]['images_per_s']:.2f} images/s, p50 {runs[-1]['p50_ms']:.0f} ms")
        for variant, max_batch in (("batched", args.max_batch), ("unbatched", 1)):
            runs += served(engine, (w, h), args.steps, max_batch, args.max_wait_ms / 1000, args.clients,
                           args.requests, variant)  # fmt: skip
    rows = median_rows(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(resolution=f"{w}x{h}", steps=args.steps, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                    requests=args.requests, repeats=args.repeats, model_flags=model_flags)  # fmt: skip
    result = dict(env=env, settings=settings, rows=rows, runs=runs)
    (args.out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    md = table(rows)
    (args.out / "serve.md").write_text(f"{md}\n\n{json.dumps(settings)}\n{json.dumps(env)}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
