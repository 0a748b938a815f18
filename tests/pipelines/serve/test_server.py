"""``bcg-serve`` end to end: a real server process on a loopback port (the tiny Z-Image-style
model on the CPU, one server for the module), talked to over HTTP with httpx. Every endpoint,
every bad input (refused in one line, nothing queued), images equal to the CLI's for the same
seed, and a bounded load run: every request answered once with its own image, batches joined,
memory flat."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from pipelines.cli import main as generate
from tests.pipelines.serve.server import TINY, ServerProcess, bcg_serve, decode, make_lora

FLAGS = [*TINY, "--max-batch", "4", "--max-wait-ms", "20", "--queue", "64"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, lora: Path) -> Iterator[ServerProcess]:
    s = ServerProcess([*FLAGS, "--lora", f"style={lora}"], tmp_path_factory.mktemp("serve") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


def test_bad_flags_are_one_line_and_status_2_before_anything_starts(tmp_path: Path, lora: Path) -> None:
    for argv, says in [
        (["--max-batch", "0"], "--max-batch: must be at least 1, got 0"),
        (["--resolutions", "65x64"], "--resolutions"),
        (["--timeout", "inf"], "--timeout"),
        (["--port", "70000"], "--port: must be 0 to 65535"),
        (["--lora", str(lora)], "--lora takes NAME=FILE[:SCALE] here"),
        (["--lora", f"style={tmp_path / 'none.safetensors'}"], "none.safetensors' does not exist"),
        (["--lora", f"a={lora}", "--lora", f"a={lora}:0.5"], "each adapter needs a name of its own"),
        (["--parallel", "cfg", "--port", "0"], "--parallel cfg computes each image on several processes: start"),
        (["--parallel", "cfg", "--batching", "continuous"], "serve --parallel cfg with --batching dynamic"),
        (["--model", "wan"], "--model wan makes videos and bcg-serve serves images"),
        (["--max-steps", "1001"], "--max-steps: must be 1 to 1000"),
        (["--model", "./folder", "--size", "full"], "--size full sizes the built-in random-weight models"),
    ]:
        run = subprocess.run([*bcg_serve(), *argv], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, (argv, run.stderr)
        assert run.stderr.count("\n") == 1 and says in run.stderr, run.stderr
    helped = subprocess.run([*bcg_serve(), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--parallel" in helped.stdout
    assert "--max-steps" in helped.stdout and "--served-model-name" in helped.stdout
    # A model name the builders do not know is found when the build starts: status 2 all the same.
    run = subprocess.run([*bcg_serve(), "--model", "no-such-model", "--port", "0"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert "ERROR bcg-serve: could not start: unknown model 'no-such-model'" in run.stderr


def test_a_port_in_use_is_refused_in_one_line(server: ServerProcess) -> None:
    port = server.url.rsplit(":", 1)[1]
    run = subprocess.run([*bcg_serve(), "--port", port], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and run.stderr.count("\n") == 1


def test_every_endpoint(server: ServerProcess) -> None:
    c = server.client
    assert c.get("/health").json() == {"status": "ok", "phase": "ready"}
    assert c.get("/ready").json() == {"status": "ready"}
    (model,) = c.get("/v1/models").json()["data"]
    assert (model["id"], model["sizes"], model["max_n"], model["loras"]) == (
        "z-image",
        ["64x64", "32x32"],
        4,
        ["style"],
    )
    assert model["steps"] == 9  # the recipe's default, which a request without steps gets
    assert "zimage" in model["aliases"] and c.get("/v1/models/zimage").json() == model  # by an alias too
    missing = c.get("/v1/models/dall-e-3")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    metrics = c.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "bcg_serve_queue_depth 0.0" in metrics.text
    for path, method, status in [("/nothing", "GET", 404), ("/health", "POST", 405),
                                 ("/v1/images/generations", "GET", 405)]:  # fmt: skip
        r = c.request(method, path)
        assert r.status_code == status
        assert r.text.count("\n") == 0 and "message" in r.json()["error"]


def test_a_request_gets_a_png_per_image_with_its_seed_and_text(server: ServerProcess) -> None:
    r = server.generate(prompt="a red fox", n=2, seed=41, steps=2, size="32x32")
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["seed"] for d in data] == [41, 42]
    images = [decode(d["b64_json"]) for d in data]
    assert [im.size for im in images] == [(32, 32), (32, 32)]
    text = images[1].text
    assert (text["prompt"], text["seed"], text["steps"], text["resolution"]) == ("a red fox", "42", "2", "32x32")
    assert (text["model"], text["device"], text["mode"]) == ("z-image", "cpu", "eager")  # no CUDA: no graphs
    assert np.asarray(images[0]).std() > 0 and not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))
    random = server.generate(prompt="a red fox", steps=1, size="32x32").json()["data"][0]
    assert decode(random["b64_json"]).text["seed"] == str(random["seed"])  # drawn, and said


def test_images_equal_the_clis_for_the_same_seed(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "cli.png"
    assert generate(["--prompt", "a lighthouse", "--seed", "5", "--steps", "2", "--resolution", "64x64",
                     "--device", "cpu", "--out", str(out), "--quiet"]) == 0  # fmt: skip
    from PIL import Image

    with Image.open(out) as cli:
        cli.load()
    r = server.generate(prompt="a lighthouse", seed=5, steps=2, size="64x64")
    served = decode(r.json()["data"][0]["b64_json"])
    assert np.array_equal(np.asarray(served), np.asarray(cli))
    assert served.text == cli.text  # the same record of how it was made, field for field


def test_a_request_picks_its_adapter_and_one_without_gets_the_base_model(server: ServerProcess) -> None:
    def pixels(**extra: object) -> tuple[np.ndarray, dict[str, str]]:
        r = server.generate(prompt="a red fox", seed=3, steps=2, size="32x32", **extra)
        assert r.status_code == 200, r.text
        image = decode(r.json()["data"][0]["b64_json"])
        return np.asarray(image), image.text

    base, base_text = pixels()
    styled, styled_text = pixels(lora="style")
    again, _ = pixels()
    assert not np.array_equal(base, styled)  # the adapter changes the image
    assert np.array_equal(base, again)  # and switching it off gives the base model's back, exactly
    assert np.array_equal(styled, pixels(lora="style")[0])
    assert styled_text["lora"] == "style.safetensors:1" and "lora" not in base_text  # the CLI's record: file, scale


def test_every_request_leaves_one_access_line_with_its_id(server: ServerProcess) -> None:
    asked = {
        "ok-1": ("POST", "/v1/images/generations", {"prompt": "a fox", "steps": 1, "size": "32x32"}, 200),
        "bad-1": ("POST", "/v1/images/generations", {"prompt": "a fox", "steps": 0}, 400),
        "nope-1": ("GET", "/nothing", None, 404),
        "ready-1": ("GET", "/ready", None, 200),
    }
    for rid, (method, path, body, status) in asked.items():
        r = server.client.request(method, path, json=body, headers={"X-Request-Id": rid})
        assert (r.status_code, r.headers["x-request-id"]) == (status, rid), r.text
    fresh = server.client.get("/health").headers["x-request-id"]
    assert len(fresh) == 16  # none given: one of its own
    lines = [line for line in server.text().splitlines() if "bcg-serve.access:" in line]
    for rid, (method, path, _, status) in asked.items():
        (line,) = [line for line in lines if f"id={rid} " in line]
        assert f" {method} {path} {status} " in line, line
    (ok,) = [line for line in lines if "id=ok-1 " in line]
    for field in ("model=z-image", "size=32x32", "n=1", "steps=1", "queue_ms=", "device_ms=", "encode_ms="):
        assert field in ok, ok
    assert "device_ms=-" not in ok and "encode_ms=-" not in ok


BAD = [
    (b"not json", 400, "not JSON"),
    (b"\xc3\x28", 400, "not UTF-8"),
    (b"[]", 400, "JSON object"),
    (b'{"prompt": ""}', 400, "prompt is empty"),
    (b'{"prompt": "\\ud83d"}', 400, "not valid UTF-8"),
    (b'{"prompt": "x", "size": "48x48"}', 400, "not served (served: 64x64, 32x32)"),
    (b'{"prompt": "x", "n": 5}', 400, "n must be 1 to 4"),
    (b'{"prompt": "x", "n": 0}', 400, "n must be 1 to 4"),
    (b'{"prompt": "x", "lora": "anime"}', 400, "lora 'anime' is not loaded (loaded: style)"),
    (b'{"prompt": "x", "steps": 101}', 400, "steps must be 1 to 100 (this server's --max-steps)"),
]


def test_bad_input_is_one_line_of_json_and_nothing_is_queued(server: ServerProcess) -> None:
    before = server.metrics()
    for body, status, says in BAD:
        r = server.client.post("/v1/images/generations", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert "\n" not in r.text
        assert says in r.json()["error"]["message"], (body, r.text)
    after = server.metrics()
    for key in ("bcg_serve_images_total", "bcg_serve_batch_requests_count"):
        assert after[key] == before[key], key  # nothing reached the device
    assert after['bcg_serve_requests_total{status="400"}'] - before['bcg_serve_requests_total{status="400"}'] == 10


def test_a_load_run_answers_every_request_once_joins_batches_and_keeps_memory_flat(server: ServerProcess) -> None:
    total, clients = 200, 16
    before = server.metrics()
    rss: dict[int, int] = {}
    answers: dict[int, httpx.Response] = {}

    async def client(who: int, client: httpx.AsyncClient) -> None:
        for i in range(who, total, clients):
            body = {"prompt": f"load {i}", "seed": 1000 + i, "steps": 1, "size": "32x32"}
            answers[i] = await client.post("/v1/images/generations", json=body)
            if len(answers) in (100, total):  # the server's memory after the first and the last hundred
                rss.setdefault(len(answers), server.rss())

    async def run() -> None:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            await asyncio.gather(*(client(k, c) for k in range(clients)))

    asyncio.run(run())
    assert sorted(answers) == list(range(total))
    for i, r in answers.items():
        assert r.status_code == 200, r.text
        (image,) = r.json()["data"]
        text = decode(image["b64_json"]).text
        assert (text["prompt"], text["seed"]) == (f"load {i}", str(1000 + i))  # its own image, none swapped
    after = server.metrics()
    batches = after["bcg_serve_batch_requests_count"] - before["bcg_serve_batch_requests_count"]
    assert after["bcg_serve_batch_requests_sum"] - before["bcg_serve_batch_requests_sum"] == total
    assert after["bcg_serve_images_total"] - before["bcg_serve_images_total"] == total
    assert after['bcg_serve_requests_total{status="200"}'] - before['bcg_serve_requests_total{status="200"}'] == total
    assert batches <= total / 2, batches  # 16 clients keep the queue full: calls of several requests
    grown = rss[total] - rss[100]
    sys.stderr.write(f"load run: {batches:.0f} calls, RSS {rss[100] / 2**20:.1f} -> {rss[total] / 2**20:.1f} MiB\n")
    assert grown < 16 * 2**20, json.dumps(rss)
