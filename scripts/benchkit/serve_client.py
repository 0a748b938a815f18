"""The load of scripts/bench_serve.py's served runs, in a process of its own.

A client in the server's process shares its interpreter lock: reading a megabyte of JSON
answer there competes with the server's event loop and device worker, and its time lands in
the latency it measures. Real clients are other processes, so this one is too:

    python -m benchkit.serve_client URL CLIENTS < bodies.json

reads the request bodies (a JSON list), sends them from ``CLIENTS`` concurrent clients (client k
sends bodies k, k + CLIENTS, ... one after another) to ``URL``'s ``/v1/images/generations``, and
prints one JSON object: ``seconds`` (first request to last answer) and ``latencies`` (seconds,
each request's), or ``error`` (the first answer that was not 200). Imports httpx only.
"""

from __future__ import annotations

import asyncio
import json
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


def load(url: str, clients: int, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Send ``bodies`` from ``clients`` concurrent clients; ``seconds`` and ``latencies``, or ``error``."""
    try:
        return asyncio.run(_load(url, clients, bodies))
    except Exception as e:  # told to the parent in one line
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: Sequence[str]) -> int:
    url, clients = argv[0], int(argv[1])
    print(json.dumps(load(url, clients, json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
