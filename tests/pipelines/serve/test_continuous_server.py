"""A real ``bcg-serve --batching continuous`` process on the tiny Z-Image, graphs emulated
(tests/pipelines/serve/emulated_server.py): a burst of 64 mixed requests (sizes, steps, seeds,
guidance, n) all answered, each with its own record, every pair of equal requests that ran in one
bucket with equal bytes; OpenAI's client streams partial images and then the very image the same
request gets without streaming; SIGTERM while requests run answers every request taken (200)
and every one waiting (503), and the process exits 0.
"""

from __future__ import annotations

import base64
import concurrent.futures
import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.pipelines.serve.server import ServerProcess, decode

SIZES = ("32x32", "64x32")
EMULATED = [sys.executable, "-m", "tests.pipelines.serve.emulated_server"]
# Two sizes at three buckets, with and without guidance, at the recipe's four text lengths are more
# graphs than a runner keeps (32): a step whose graph was evicted runs eagerly, to the same bits.
FLAGS = ["--device", "cpu", "--resolutions", *SIZES, "--batch-sizes", "1", "2", "4", "--batching", "continuous"]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Three prompts whose text reaches the denoiser at a length the warm-up captured (on a CPU the
    recipe does not pad text to its lengths: graphs are CUDA's)."""
    from pipelines.builders import build_pipeline
    from pipelines.families.z_image.recipe import ZImageRecipe
    from tests.pipelines.serve.test_buckets import prompt_of_warm_length

    pipe, rng = build_pipeline("z-image"), random.Random(0)
    return [prompt_of_warm_length(pipe, ZImageRecipe(), rng, (32, 32)) for _ in range(3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(FLAGS, tmp_path_factory.mktemp("continuous") / "server.log", command=EMULATED)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


def buckets_by_id(log: str) -> dict[str, int]:
    """Each generation request's bucket, by its id, from the access log."""
    return {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"id=(\S+) POST /v1/images/generations 200 .*? bucket=(\d+)", log)
    }


def test_a_burst_of_64_mixed_requests_is_answered_every_one_right(server: ServerProcess, prompts: list[str]) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    distinct = [dict(prompt=rng.choice(prompts), size=rng.choice(SIZES), n=rng.choice((1, 1, 2)),
                     steps=rng.choice((1, 2, 3, 4)), seed=rng.randrange(10**6), guidance=rng.choice((0.0, 2.0, 4.5)))
                for _ in range(32)]  # fmt: skip
    bodies = distinct * 2
    rng.shuffle(bodies)
    replays = server.metrics()['bcg_serve_denoiser_calls_total{kind="replay"}']

    def send(i: int) -> tuple[int, dict[str, Any], httpx.Response]:
        return i, bodies[i], server.client.post("/v1/images/generations", json=bodies[i],
                                                headers={"X-Request-Id": f"burst-{seed}-{i}"})  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(len(bodies))))
    assert [r.status_code for _, _, r in answers] == [200] * len(bodies), f"seed {seed}: {server.text()[-3000:]}"
    buckets = buckets_by_id(server.text())
    seen: dict[tuple[Any, ...], list[tuple[int, list[bytes]]]] = {}
    for i, body, response in answers:
        data = response.json()["data"]
        assert len(data) == body["n"] and [d["seed"] for d in data] == [body["seed"] + k for k in range(body["n"])]
        files = [base64.b64decode(d["b64_json"]) for d in data]
        for k, f in enumerate(files):
            image = decode(base64.b64encode(f).decode())
            assert image.size == tuple(map(int, body["size"].split("x")))
            text = image.text
            assert (text["prompt"], text["seed"], text["steps"]) == (body["prompt"], str(body["seed"] + k),
                                                                     str(body["steps"])), f"seed {seed}: {text}"  # fmt: skip
            assert float(text["guidance"]) == body["guidance"]
        key = tuple(sorted(body.items()))
        seen.setdefault(key, []).append((buckets[f"burst-{seed}-{i}"], files))
    same_bucket = 0
    for (b1, f1), (b2, f2) in seen.values():
        if b1 == b2:
            same_bucket += 1
            assert f1 == f2, f"seed {seed}: one request answered twice in bucket {b1}, two images"
    assert same_bucket, f"seed {seed}: no request ran twice in one bucket"
    assert server.metrics()['bcg_serve_denoiser_calls_total{kind="replay"}'] > replays


def test_openai_streams_partial_images_then_the_image_it_answers_without_streaming(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"seed": 11, "steps": 6}
    events = list(client.images.generate(model="z-image", prompt="a red fox", size="32x32", stream=True,
                                         partial_images=2, extra_body=extra))  # fmt: skip
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "32x32" and e.output_format == "png" for e in events)
    plain = client.images.generate(model="z-image", prompt="a red fox", size="32x32", extra_body=extra)
    assert events[-1].b64_json == plain.data[0].b64_json  # the same file, bit for bit
    previews = [decode(e.b64_json) for e in events[:2]]
    final = decode(events[-1].b64_json)
    assert all(p.size == final.size for p in previews)
    assert previews[0].tobytes() != previews[1].tobytes() != final.tobytes()  # each a later estimate
    none = list(client.images.generate(model="z-image", prompt="a red fox", size="32x32", stream=True,
                                       extra_body=extra))  # fmt: skip
    assert [e.type for e in none] == ["image_generation.completed"] and none[0].b64_json == plain.data[0].b64_json
    with pytest.raises(openai.BadRequestError, match="stream takes n=1"):
        client.images.generate(model="z-image", prompt="x", size="32x32", n=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="partial_images must be 0 to 3"):
        client.images.generate(model="z-image", prompt="x", size="32x32", stream=True, partial_images=4)
    client.close()


def test_sigterm_while_requests_run_answers_every_request_taken(tmp_path: Path, prompts: list[str]) -> None:
    s = ServerProcess([*FLAGS, "--batch-sizes", "1", "2"], tmp_path / "server.log", command=EMULATED)
    s.wait_ready()
    bodies = [dict(prompt=prompts[i % 3], size="32x32", steps=40 + i, seed=i) for i in range(5)]

    def post(body: dict[str, Any]) -> int:
        with httpx.Client(base_url=s.url, timeout=120) as client:
            return client.post("/v1/images/generations", json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        sent = [pool.submit(post, b) for b in bodies]
        deadline = time.monotonic() + 60
        while s.metrics()['bcg_serve_denoiser_calls_total{kind="replay"}'] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # the running batches have taken their first steps
        assert s.stop() == 0, s.text()
        statuses = sorted(f.result() for f in sent)
    assert set(statuses) <= {200, 503} and 200 in statuses, statuses
    assert statuses.count(200) == 2, f"{statuses}: the two rows running (2 at most) finish; what waited is told 503"
