"""Streaming (``stream: true``, ``--batching continuous``) through bcg-serve --ray, on the local
Ray cluster of :mod:`.test_ray_app` (its fixtures), the tiny Z-Image on the CPU.

One application (two replicas, two adapters, one slot each, one request at a time a replica)
answers, in turn:

* OpenAI's client streaming: the partial images asked for, then the image, the very file the same
  request gets unstreamed through --ray and from one plain ``bcg-serve --batching continuous``;
* streamed requests naming adapters: each goes to the replica that loaded its adapter (which
  never loads it again), each image that plain bcg-serve's;
* a client that leaves mid-stream: its replica gives the request up (Ray's metrics count it
  dropped while running), computes nothing more for it, and takes the adapter's next request
  (one request at a time: a full holder would leave it to the other replica).

(With --batching dynamic, ``stream`` is bcg-serve's 400: :mod:`.test_ray_app`'s last test.)
"""

# The cluster's fixtures are test_ray_app's, imported: the test's arguments name them again.
# ruff: noqa: F811

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray", reason="the [ray] extra")

from tests.pipelines.serve.ray.test_ray_app import (  # noqa: E402, F401 (fixtures)
    METRICS_PORT,
    MODEL,
    _wait,
    adapters,
    deployed,
    url,
)
from tests.pipelines.serve.server import ServerProcess  # noqa: E402

BODY = {"prompt": "a red fox", "size": "32x32", "seed": 11, "steps": 6}


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A server-sent events answer's events, each its name and its data's JSON."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def series(name: str, **labels: str) -> dict[str, float]:
    """Ray's metrics endpoint: ``name``'s value per Generator replica, of the samples with ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT[0]}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("deployment") == "Generator" and labels.items() <= s.labels.items():
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def test_streams_cross_ray_as_bcg_serve_makes_them(
    url: str, deployed: Any, adapters: dict[str, str], tmp_path: Path
) -> None:
    lora_flags = [flag for spec in adapters.values() for flag in ("--lora", spec)]
    continuous = ["--batching", "continuous", *lora_flags]
    named = [{**BODY, "lora": name, "seed": 20 + i} for i, name in enumerate(["ink", "oil", "ink", "oil", "ink"])]

    # The reference: one plain bcg-serve, unstreamed.
    one = ServerProcess([*MODEL, *continuous], tmp_path / "one.log")
    try:
        one.wait_ready()
        want = [one.generate(**b).json()["data"][0]["b64_json"] for b in (BODY, *named)]
    finally:
        one.stop()

    http = deployed("--min-replicas", "2", "--max-models-per-replica", "1", "--queue", "1", "--max-steps", "400",
                    *continuous)  # fmt: skip
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"seed": BODY["seed"], "steps": BODY["steps"]}
    events = list(client.images.generate(model="z-image", prompt=BODY["prompt"], size="32x32", stream=True,
                                         partial_images=2, extra_body=extra))  # fmt: skip
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    unstreamed = client.images.generate(model="z-image", prompt=BODY["prompt"], size="32x32", extra_body=extra)
    assert events[-1].b64_json == unstreamed.data[0].b64_json == want[0]  # the same file, bit for bit
    assert events[0].b64_json != events[1].b64_json != events[-1].b64_json  # each a later estimate
    none = list(client.images.generate(model="z-image", prompt=BODY["prompt"], size="32x32", stream=True,
                                       extra_body=extra))  # fmt: skip
    assert [e.type for e in none] == ["image_generation.completed"] and none[0].b64_json == want[0]
    with pytest.raises(openai.BadRequestError, match="stream takes n=1"):
        client.images.generate(model="z-image", prompt="x", size="32x32", n=2, stream=True)
    client.close()

    # Streamed requests naming adapters: each to the replica that loaded its adapter.
    holder: dict[str, str] = {}
    for i, body in enumerate(named):
        r = http.post("/v1/images/generations", json={**body, "stream": True, "partial_images": 1})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        replica, loads = r.headers["x-bcg-replica"], int(r.headers["x-bcg-adapter-loads"])
        got = sse(r.text)
        assert [name for name, _ in got] == ["image_generation.partial_image", "image_generation.completed"]
        assert got[-1][1]["b64_json"] == want[1 + i], f"streamed request {i} ({body['lora']}) differs from bcg-serve's"
        if body["lora"] not in holder:
            holder[body["lora"]] = replica
            assert loads == 1
            time.sleep(2)  # the replica tells the routers what it holds (see test_ray_app)
        else:
            assert (replica, loads) == (holder[body["lora"]], 1), f"request {i}: replica {replica}, loads {loads}"
    assert holder["ink"] != holder["oil"]

    # A client that leaves mid-stream: 400 steps, gone after its first preview (step 100).
    dropped = "ray_bcg_serve_dropped_total"
    before = series(dropped, reason="disconnected_running").get(holder["ink"], 0.0)
    long = {**BODY, "lora": "ink", "steps": 400, "stream": True, "partial_images": 3}
    t0 = time.monotonic()
    with http.stream("POST", "/v1/images/generations", json=long) as r:
        assert r.status_code == 200 and r.headers["x-bcg-replica"] == holder["ink"]
        first = next(r.iter_lines())
        assert first == "event: image_generation.partial_image", first
    hundred = time.monotonic() - t0
    _wait(lambda: series(dropped, reason="disconnected_running").get(holder["ink"]) == before + 1, 30,
          "the replica giving up the stream its client left")  # fmt: skip
    # Nothing more is computed for it (its 300 steps left would take about 3 x `hundred`).
    calls = "ray_bcg_serve_denoiser_calls_total"
    time.sleep(1.5)  # Ray's metrics come every 0.5 s
    stopped = series(calls)[holder["ink"]]
    time.sleep(2)
    assert series(calls)[holder["ink"]] == stopped, (
        f"still computing for a client that left (100 steps: {hundred:.1f} s)"
    )
    # The replica's one request slot is free: the adapter's next request goes to it (a full holder
    # would leave it to the other replica, which would load the adapter).
    r = http.post("/v1/images/generations", json={**named[0], "stream": False})
    assert r.status_code == 200, r.text
    assert (r.headers["x-bcg-replica"], r.headers["x-bcg-adapter-loads"]) == (holder["ink"], "1")
    assert r.json()["data"][0]["b64_json"] == want[1]
