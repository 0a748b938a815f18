"""scripts/bench_serve.py's timed runs, all on one warm engine (:class:`pipelines.serve.engine.Engine`).

* :func:`pipeline_rate`: the pipeline's own call, one image at a time, as ``bcg-generate`` makes
  it (no PNG, no server): the single-call rate everything else is compared with;
* :func:`bucket_rates`: one call of each batch-size bucket through the engine (PNGs included);
* :func:`loop`: one request after another through the engine, no HTTP;
* :func:`served`: a real server on a loopback port (uvicorn in a thread) over the same engine,
  dynamic or continuous batching, with clients sending their share of the requests one after
  another (closed loop), or requests sent at Poisson arrivals of a given rate (open loop), from a
  process of their own (:mod:`benchkit.serve_client`: in the server's process they would share its
  interpreter lock).

Device work runs on a thread of its own, as the server's device worker: on a CPU, torch's OpenMP
threads run differently from the main thread (on a loaded machine a call took 10x longer there).
Each run returns a row: images/s, p50/p95 latency and, for the server, requests per call and
the server-side split of a request's mean latency (:func:`split`, from ``/metrics`` scraped
before and after the run): queue wait, device (its pipeline call, ``Engine.make``'s host work
included), encoding (files and base64, on the server's encoding threads) and the rest (HTTP, JSON, the
client, the hand-offs between threads) as the client's mean latency less those three.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Load", "Settings", "bucket_rates", "loop", "pipeline_rate", "scrape", "served", "split"]

PROMPT = "a red fox in the snow, take {i}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every timed request asks for: size, steps, and the adapter (None: none)."""

    width: int
    height: int
    steps: int
    lora: str | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def body(self, i: int) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": PROMPT.format(i=i), "seed": i, "size": self.size, "steps": self.steps}
        if self.lora is not None:
            body["lora"] = self.lora
        return body

    def request(self, i: int, n: int = 1) -> Any:
        from pipelines.serve.schema import ImageRequest

        return ImageRequest(PROMPT.format(i=i), n, self.width, self.height, seed=i, steps=self.steps, lora=self.lora)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(variant: str, clients: int, seconds: float, latencies: Sequence[float], images: int,
        calls: float | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """One result row; ``latencies`` are seconds per request (or per call)."""
    return dict(variant=variant, clients=clients, requests=len(latencies), images=images, seconds=round(seconds, 4),
                images_per_s=round(images / seconds, 3), p50_ms=round(1000 * percentile(latencies, 0.5), 2),
                p95_ms=round(1000 * percentile(latencies, 0.95), 2), p99_ms=round(1000 * percentile(latencies, 0.99), 2),
                requests_per_call=round(len(latencies) / calls, 3) if calls else None, **extra)  # fmt: skip


def scrape(text: str) -> dict[str, float]:
    """The unlabelled samples of a ``/metrics`` answer (the histograms' ``_sum`` and ``_count``)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def split(before: dict[str, float], after: dict[str, float], latencies: Sequence[float]) -> dict[str, float]:
    """Milliseconds per request, means over a run's ``latencies`` (seconds, the client's), between
    two scrapes: ``queue`` (arrival to its batch taken), ``device`` (its batch's pipeline calls),
    ``encode`` (its images' files), ``rest`` (the mean latency less those), and ``server``
    (arrival to its images encoded, the server's own measure: the rest less HTTP and JSON); and
    the device's ``runs`` (pipeline calls, or continuous batching's steps), their mean bucket
    (``bucket_mean``) and mean rows of requests (``rows_mean``)."""

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(name: str, per: float | None = None) -> float:
        count = grew(f"{name}_count") if per is None else per
        return 1000 * grew(f"{name}_sum") / count if count else 0.0

    total = 1000 * sum(latencies) / len(latencies)
    # Per pipeline call (dynamic) or per step (continuous): the bucket it ran at and the rows that
    # were requests': whether continuous batching ran small buckets at saturation.
    runs = grew("bcg_serve_batch_size_count")
    bucket = grew("bcg_serve_batch_size_sum") / runs if runs else 0.0
    shape = dict(
        runs=runs, bucket_mean=bucket, rows_mean=bucket - grew("bcg_serve_padded_rows_total") / runs if runs else 0.0
    )
    parts = dict(queue=mean("bcg_serve_queue_seconds"), device=mean("bcg_serve_device_seconds"),
                 encode=mean("bcg_serve_encode_seconds", per=len(latencies)))  # fmt: skip
    out = dict(mean_ms=total, **{f"{k}_ms": v for k, v in parts.items()}, rest_ms=total - sum(parts.values()),
               server_ms=mean("bcg_serve_request_seconds"), **shape)  # fmt: skip
    return {k: round(v, 2) for k, v in out.items()}


def clients_process(port: int, clients: int, bodies: Sequence[dict[str, Any]], rate: float | None = None,
                    seconds: float = 60.0, seed: int = 0) -> tuple[float, list[float]]:  # fmt: skip
    """``bodies`` sent to the loopback server on ``port`` by ``clients`` concurrent clients, or at
    Poisson arrivals of ``rate`` a second for at most ``seconds`` (open loop), from a process of
    their own (:mod:`benchkit.serve_client`): (seconds from the first request to the last answer,
    each request's latency in seconds). RuntimeError, in one line, for an answer that was not 200."""
    scripts = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (scripts, os.environ.get("PYTHONPATH")) if p))
    url = f"http://127.0.0.1:{port}"
    how = [str(clients)] if rate is None else ["--rate", str(rate), "--seconds", str(seconds), "--seed", str(seed)]
    done = subprocess.run([sys.executable, "-m", "benchkit.serve_client", url, *how], input=json.dumps(bodies),
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr.strip()[-300:]}
    if "error" in result:
        raise RuntimeError(f"the clients failed: {result['error']}")
    return result["seconds"], result["latencies"]


def on_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own (see the module docstring); its exception is raised here."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # told in the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def _sync(engine: Any) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)


def pipeline_rate(engine: Any, s: Settings, calls: int) -> dict[str, Any]:
    """``calls`` calls of the pipeline itself, one image each, with the request's settings."""
    from pipelines.generation import Job

    def run() -> dict[str, Any]:
        engine.adapters.select(s.lora)
        took: list[float] = []
        for i in range(calls):
            plan = engine.plan(s.request(i))
            _sync(engine)
            t0 = time.perf_counter()
            engine.prepared.generate(Job(plan.request.prompt, s.width, s.height, (0,), plan.seeds), call=plan.call)
            took.append(time.perf_counter() - t0)
        return row("pipeline", 1, sum(took), took, calls)

    return on_thread(run)


def bucket_rates(engine: Any, s: Settings, repeats: int = 2) -> list[dict[str, Any]]:
    """Per bucket, one call of that many images through the engine (its last of ``repeats``; the
    first calls at a shape pay for allocations the others do not)."""

    def run() -> list[dict[str, Any]]:
        rows = []
        for b in engine.batch_sizes or (1,):
            took = []
            for r in range(repeats):
                plans = [engine.plan(s.request(1000 * r + i)) for i in range(b)]
                t0 = time.perf_counter()
                engine.run(plans)
                took.append(time.perf_counter() - t0)
            rows.append(row("bucket", 1, took[-1], took[-1:], b, batch=b))
        return rows

    return on_thread(run)


def loop(engine: Any, s: Settings, requests: int) -> dict[str, Any]:
    """One request after another through the engine: the server's calls and PNGs, no HTTP."""

    def run() -> dict[str, Any]:
        took = []
        for i in range(requests):
            t0 = time.perf_counter()
            engine.run([engine.plan(s.request(i))])
            took.append(time.perf_counter() - t0)
        return row("loop", 1, sum(took), took, requests)

    return on_thread(run)


@dataclasses.dataclass(frozen=True)
class Load:
    """The runs of one served variant: a closed-loop run per count of ``clients``, then an open-loop
    run per rate of ``rates`` (requests a second, Poisson arrivals, at most ``seconds`` of sending),
    each of ``requests`` requests."""

    clients: Sequence[int]
    requests: int
    rates: Sequence[float] = ()
    seconds: float = 60.0


def served(engine: Any, s: Settings, max_batch: int, max_wait: float, load: Load, variant: str,
           say: Callable[[str], None], batching: str = "dynamic") -> list[dict[str, Any]]:  # fmt: skip
    """A real server over ``engine`` on a free loopback port, calls of at most ``max_batch``
    images (``batching`` dynamic) or running batches of at most that many rows (continuous), and
    the runs of ``load``."""
    import httpx
    import uvicorn

    from pipelines.serve.app import create_app
    from pipelines.serve.batcher import Batcher
    from pipelines.serve.schema import Served
    from pipelines.serve.service import Service

    if batching == "continuous" and engine.steps is None:
        from pipelines.stepwise.family import steps_for

        engine.steps = steps_for(engine.pipe)  # the same warm graphs serve both: the buckets' shapes
    loras = tuple(engine.adapters.names())
    most = max([*load.clients, *(int(r * load.seconds) + 1 for r in load.rates)] or [1])
    batcher = Batcher(max(64, 2 * most), max_batch, max_wait)
    service = Service(Served("bench", ((s.width, s.height),), max_batch, loras, batch_sizes=engine.batch_sizes or ()),
                      batcher, lambda: engine, timeout=600, batching=batching)  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="off"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    service.start()
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started or service.phase != "ready":
        if not thread.is_alive() or service.phase == "failed" or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start ({service.fatal})")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    rows = []
    calls: list[int] = []  # images of each pipeline call, in order: where padding went
    make = engine.make

    def counted(plans: Sequence[Any], stop: Callable[[], bool] | None = None) -> Any:
        calls.append(sum(len(p.seeds) for p in plans))
        return make(plans, stop)

    engine.make = counted
    runs = [(count, None) for count in load.clients] + [(0, rate) for rate in load.rates]
    try:
        for count, rate in runs:
            calls_before = service.worker.batches
            calls.clear()
            before = scrape(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text)
            seconds, latencies = clients_process(port, count, [s.body(i) for i in range(load.requests)], rate,
                                                 load.seconds)  # fmt: skip
            after = scrape(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text)
            made = service.worker.batches - calls_before if batching == "dynamic" else None
            extra = dict(arrival_rate=rate) if rate is not None else {}
            rows.append(row(variant, count, seconds, latencies, len(latencies), made, max_batch=max_batch,
                            call_images=list(calls), **extra, **split(before, after, latencies)))  # fmt: skip
            r = rows[-1]
            who = f"{count:>2} client(s)" if rate is None else f"{rate:g}/s arrivals ({len(latencies)} requests)"
            say(f"{variant:>10} {who}: {r['images_per_s']:.2f} images/s, p50 {r['p50_ms']:.0f} ms, p95 "
                f"{r['p95_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, {r['requests_per_call'] or '-'} requests a call; "
                f"mean {r['mean_ms']:.0f} ms = queue {r['queue_ms']:.0f} + device {r['device_ms']:.0f} + encode "
                f"{r['encode_ms']:.0f} + rest {r['rest_ms']:.0f}; images a call: {' '.join(map(str, calls)) or '-'}")  # fmt: skip
    finally:
        del engine.make  # the class's again
        service.stop()
        server.should_exit = True
        thread.join(60)
        service.worker.join(60)
    return rows
