"""The load of scripts/bench_serve.py's served runs, in a process of its own.

A client in the server's process shares its interpreter lock: reading a megabyte of JSON
answer there competes with the server's event loop and device worker, and its time lands in
the latency it measures. Real clients are other processes, so this one is too:

    python -m benchkit.serve_client URL CLIENTS < bodies.json
    python -m benchkit.serve_client URL --rate R --seconds S --seed N < bodies.json

reads the request bodies (a JSON list) and sends them to ``URL``'s ``/v1/images/generations``
(a loopback address: the bench never sends elsewhere). Closed loop: ``CLIENTS`` concurrent
clients, client k sending bodies k, k + CLIENTS, ... one after another. Open loop (``--rate``):
each body at its own time, the gaps drawn from an exponential distribution of mean ``1 / R``
seconds (Poisson arrivals, seeded), whatever the answers, until the bodies or ``S`` seconds of
sending run out. Prints one JSON object: ``seconds`` (first request to last answer),
``latencies`` (seconds, each request's) and ``sent``, or ``error`` (the first answer that was not
200). Imports httpx only.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["load"]


async def _load(url: str, clients: int, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    import httpx

    latencies: list[float] = []

    async def client(who: int, c: httpx.AsyncClient) -> None:
        for i in range(who, len(bodies), clients):
            t0 = time.perf_counter()
            r = await c.post("/v1/images/generations", json=bodies[i])
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: {r.status_code} {r.text[:300]}")
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(k, c) for k in range(clients)))
        return {"seconds": time.perf_counter() - t0, "latencies": latencies}


async def _open_loop(url: str, rate: float, seconds: float, seed: int,
                     bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    import httpx

    latencies: list[float] = []
    gaps = random.Random(seed)

    async def send(i: int, c: httpx.AsyncClient) -> None:
        t0 = time.perf_counter()
        r = await c.post("/v1/images/generations", json=bodies[i])
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: {r.status_code} {r.text[:300]}")
        latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        due, sent = t0, []
        for i in range(len(bodies)):
            if due - t0 > seconds:
                break
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent.append(asyncio.ensure_future(send(i, c)))
            due += gaps.expovariate(rate)
        await asyncio.gather(*sent)
        return {"seconds": time.perf_counter() - t0, "latencies": latencies, "sent": len(sent)}


def load(url: str, clients: int, bodies: Sequence[dict[str, Any]], rate: float | None = None,
         seconds: float = 60.0, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Send ``bodies`` from ``clients`` concurrent clients, or at Poisson arrivals of ``rate`` per
    second for at most ``seconds``; ``seconds``, ``latencies`` and ``sent``, or ``error``."""
    try:
        if rate is not None:
            return asyncio.run(_open_loop(url, rate, seconds, seed, bodies))
        out = asyncio.run(_load(url, clients, bodies))
        return {**out, "sent": len(bodies)}
    except Exception as e:  # told to the parent in one line
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: Sequence[str]) -> int:
    url = argv[0]
    if not url.startswith(("http://127.0.0.1:", "http://localhost:", "http://[::1]:")):
        print(json.dumps({"error": f"{url}: the bench sends to a loopback address only"}))
        return 0
    if argv[1] == "--rate":
        rate, seconds, seed = float(argv[2]), float(argv[4]), int(argv[6])
        print(json.dumps(load(url, 0, json.load(sys.stdin), rate, seconds, seed)))
        return 0
    print(json.dumps(load(url, int(argv[1]), json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
