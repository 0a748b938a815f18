"""A real ``bcg-serve`` process whose graphs are captured and replayed (emulated on the CPU:
tests/pipelines/serve/emulated_server.py): ``/ready`` turns 200 only once the warm-up is done; the
warm-up captures the buckets only and logs each one's time; a size the warm-up left out is a 400
listing the sizes served, unless ``--capture-on-miss``; ``/metrics`` has the histograms of batch
size, queue wait and per-image time, each bucket's warm-up seconds and the graph memory in use;
and concurrent requests are joined into calls of one bucket that replay the warm-up's graphs."""

from __future__ import annotations

import concurrent.futures
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipelines.serve.server import ServerProcess, decode
from tests.pipelines.serve.test_buckets import prompt_of_warm_length

EMULATED = [sys.executable, "-m", "tests.pipelines.serve.emulated_server"]
FLAGS = ["--device", "cpu", "--resolutions", "32x32", "64x64", "--warmup", "32x32", "--batch-sizes", "1", "2", "4",
         "--max-wait-ms", "1000"]  # fmt: skip


def warm_prompt() -> str:
    """A prompt whose text length the warm-up captured (on a CPU no recipe pads text to one)."""
    from pipelines.builders import build_pipeline
    from pipelines.families.z_image.recipe import ZImageRecipe

    pipe = build_pipeline("z-image", size="tiny", seed=0)
    return prompt_of_warm_length(pipe, ZImageRecipe(), random.Random(0), (32, 32))


def start(tmp: Path, *extra: str, gate: Path | None = None) -> ServerProcess:
    env = {"BCG_TEST_WARMUP_GATE": str(gate)} if gate is not None else {}
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # ServerProcess passes this process's environment on
    try:
        return ServerProcess([*FLAGS, *extra], tmp / "server.log", command=EMULATED)
    finally:
        for k, v in previous.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A server whose warm-up waits for a file: (the server, the file)."""
    tmp = tmp_path_factory.mktemp("warm")
    s = start(tmp, gate=tmp / "go")
    try:
        yield s, tmp / "go"
    finally:
        assert s.stop() == 0, s.text()


def test_ready_only_after_the_warm_up_and_a_cold_size_is_a_4xx_listing_the_sizes_served(
    gated: tuple[ServerProcess, Path],
) -> None:
    server, gate = gated
    deadline = time.monotonic() + 60
    while "warming up 32x32" not in server.text() and time.monotonic() < deadline:
        time.sleep(0.05)  # built; its warm-up now waits for the gate
    assert server.client.get("/health").json() == {"status": "ok", "phase": "starting"}
    ready = server.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "starting"
    r = server.generate(prompt="early", size="32x32", steps=1)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "warming_up"
    gate.touch()
    server.wait_ready()
    assert server.client.get("/ready").json() == {"status": "ready"}
    log = server.text()
    for bucket in (4, 2, 1):
        assert f"warm-up of batch size {bucket}: " in log, log
    assert "warm-up of batch size 3" not in log
    assert "not warmed up, so not served: 64x64 (--capture-on-miss serves them)" in log
    (model,) = server.client.get("/v1/models").json()["data"]
    assert (model["sizes"], model["batch_sizes"], model["max_n"]) == (["32x32"], [1, 2, 4], 4)
    cold = server.generate(prompt="a fox", size="64x64", steps=1)
    assert cold.status_code == 400 and "\n" not in cold.text
    error = cold.json()["error"]
    assert (error["param"], error["code"]) == ("size", "size_not_warm")
    assert error["message"] == ("size '64x64' was not warmed up (served: 32x32; bcg-serve --capture-on-miss serves it "
                                "by capturing its first call)")  # fmt: skip


def test_joined_requests_replay_a_bucket_and_the_metrics_show_it(gated: tuple[ServerProcess, Path]) -> None:
    server, gate = gated
    gate.touch()
    server.wait_ready()
    before = server.metrics()
    prompt = warm_prompt()
    bodies = [dict(prompt=prompt, n=n, seed=10 * i, steps=2, size="32x32") for i, n in enumerate((1, 2))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # together within --max-wait-ms: one call of 3 images
        answers = list(pool.map(lambda body: server.generate(**body), bodies))
    for r in answers:
        assert r.status_code == 200, r.text
        assert all(decode(d["b64_json"]).text["mode"] == "bcg" for d in r.json()["data"])  # replayed, not eager
    m = server.metrics()

    def grew(key: str) -> float:
        return m[key] - before.get(key, 0.0)

    assert grew("bcg_serve_batch_size_count") == 1 and grew('bcg_serve_batch_size_bucket{le="4.0"}') == 1
    assert grew('bcg_serve_batch_size_bucket{le="2.0"}') == 0  # 3 images ran at bucket 4
    assert grew("bcg_serve_padded_rows_total") == 1
    assert grew("bcg_serve_queue_seconds_count") == 2 and grew("bcg_serve_image_seconds_count") == 3
    assert grew('bcg_serve_pipeline_calls_total{ran="graphs"}') == 1
    assert grew('bcg_serve_denoiser_calls_total{kind="eager"}') == 0
    assert grew('bcg_serve_denoiser_calls_total{kind="replay"}') > 0
    assert m["bcg_serve_graph_memory_bytes"] > 0 and m["bcg_serve_ready"] == 1
    assert {b: m[f'bcg_serve_warmup_seconds{{batch_size="{b}"}}'] > 0 for b in (1, 2, 4)} == {1: True, 2: True, 4: True}


def test_capture_on_miss_serves_a_size_the_warm_up_left_out(tmp_path: Path) -> None:
    server = start(tmp_path, "--capture-on-miss")
    try:
        server.wait_ready()
        (model,) = server.client.get("/v1/models").json()["data"]
        assert model["sizes"] == ["32x32", "64x64"]
        r = server.generate(prompt="a fox", size="64x64", steps=1)
        assert r.status_code == 200, r.text
        assert decode(r.json()["data"][0]["b64_json"]).size == (64, 64)
    finally:
        assert server.stop() == 0, server.text()
