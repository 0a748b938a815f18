"""The server under pressure, with the device held busy on cue (:mod:`held_server`: a prompt
``hold:PATH`` keeps its pipeline call running until PATH exists, ``boom`` fails it): compatible
waiting requests join one call and others do not, a full queue answers 429 with Retry-After, a
client that leaves and a request past ``--timeout`` have their queued work dropped (and a running
call whose requests all gave up stops at its next step's end), a failed
batch fails only its own requests, and SIGTERM while busy finishes the running batch, answers
the waiting ones 503 and exits 0."""

from __future__ import annotations

import concurrent.futures
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pipelines.serve.server import TINY, ServerProcess, decode

HELD = [sys.executable, "-m", "tests.pipelines.serve.held_server"]
FLAGS = [*TINY, "--max-batch", "4", "--max-wait-ms", "0", "--queue", "6"]
BRIEF = 3.0  # the --timeout of the server that tests it (the others keep the default, 300 s)


def started(path: Path, flags: list[str]) -> Iterator[ServerProcess]:
    s = ServerProcess(flags, path, command=HELD)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from started(tmp_path_factory.mktemp("held") / "server.log", FLAGS)


@pytest.fixture
def brief(tmp_path: Path) -> Iterator[ServerProcess]:
    yield from started(tmp_path / "server.log", [*FLAGS, "--timeout", str(BRIEF), "--max-steps", "1000"])


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(16) as p:
        yield p


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def post(url: str, timeout: float = 120, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"steps": 1, "size": "32x32", **body}, timeout=timeout)


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before[key]


def hold(server: ServerProcess, pool: concurrent.futures.Executor, path: Path) -> concurrent.futures.Future:
    """A request whose call runs until ``path`` exists; returns once the device is busy with it."""
    taken = server.metrics()["bcg_serve_queue_seconds_count"]  # counts requests the worker took
    running = pool.submit(post, server.url, prompt=f"hold:{path}")
    wait_for(lambda: server.metrics()["bcg_serve_queue_seconds_count"] > taken, "the held call runs")
    return running


def queued(server: ServerProcess, depth: int) -> None:
    wait_for(lambda: server.metrics()["bcg_serve_queue_depth"] == depth, f"{depth} request(s) waiting")


def test_waiting_requests_of_one_key_join_one_call_and_others_do_not(server: ServerProcess, pool: Any,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    before = server.metrics()
    release = tmp_path / "go"
    held = hold(server, pool, release)
    small = [pool.submit(post, server.url, prompt=f"fox {i}", seed=i) for i in range(3)]
    queued(server, 3)
    other = pool.submit(post, server.url, prompt="fox big", seed=9, size="64x64")  # another size: another call
    two = pool.submit(post, server.url, prompt="fox pair", seed=20, n=2)  # 3 + 2 > 4: the next call
    queued(server, 5)
    release.touch()
    answers = [f.result(60) for f in [held, *small, other, two]]
    assert [r.status_code for r in answers] == [200] * 6
    assert [decode(r.json()["data"][0]["b64_json"]).text["prompt"] for r in answers[1:4]] == ["fox 0", "fox 1", "fox 2"]
    after = server.metrics()
    # The held call alone, then the three 32x32 requests as one call, then the 64x64 one and the
    # pair, each alone (the pair did not fit beside the three).
    assert delta(before, after, "bcg_serve_batch_requests_count") == 4
    assert delta(before, after, 'bcg_serve_batch_requests_bucket{le="1.0"}') == 3
    assert delta(before, after, 'bcg_serve_batch_images_bucket{le="3.0"}') - delta(
        before, after, 'bcg_serve_batch_images_bucket{le="2.0"}') == 1  # fmt: skip
    assert delta(before, after, "bcg_serve_images_total") == 7


def test_a_full_queue_answers_429_with_retry_after(server: ServerProcess, pool: Any, tmp_path: Path) -> None:
    release = tmp_path / "go"
    held = hold(server, pool, release)
    waiting = [pool.submit(post, server.url, prompt=f"wait {i}", size="64x64" if i % 2 else "32x32")
               for i in range(6)]  # fmt: skip
    queued(server, 6)
    ready = server.client.get("/ready")  # a request would be refused now: not ready, and why
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "queue_full"
    refused = post(server.url, prompt="one too many")
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert "queue is full (6 requests waiting)" in refused.json()["error"]["message"] and "\n" not in refused.text
    release.touch()
    assert [f.result(60).status_code for f in [held, *waiting]] == [200] * 7


def test_a_client_that_leaves_has_its_queued_work_dropped(server: ServerProcess, pool: Any, tmp_path: Path) -> None:
    before = server.metrics()
    release = tmp_path / "go"
    held = hold(server, pool, release)
    with pytest.raises(httpx.ReadTimeout):  # sent, then no answer while the device is held
        post(server.url, timeout=1.0, prompt="impatient")  # httpx closes the connection as it gives up
    wait_for(lambda: server.metrics()['bcg_serve_dropped_total{reason="disconnected"}'] > before[
        'bcg_serve_dropped_total{reason="disconnected"}'], "the request is dropped")  # fmt: skip
    assert server.metrics()["bcg_serve_queue_depth"] == 0
    release.touch()
    assert held.result(60).status_code == 200
    after = server.metrics()
    assert delta(before, after, "bcg_serve_images_total") == 1  # the held one only: the other never ran


def test_a_request_past_the_timeout_is_504_its_work_dropped_and_its_call_stopped(brief: ServerProcess, pool: Any,
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    before = brief.metrics()
    release = tmp_path / "go"
    held = hold(brief, pool, release)
    late = post(brief.url, prompt="too late")
    assert late.status_code == 504
    assert f"not done within --timeout {BRIEF:g} s" in late.json()["error"]["message"] and "\n" not in late.text
    assert held.result(60).status_code == 504  # the held call ran past the timeout too ...
    release.touch()
    stopped = 'bcg_serve_pipeline_calls_total{ran="stopped"}'
    wait_for(lambda: brief.metrics()[stopped] > before[stopped], "its call stops at its first step's end")
    after = brief.metrics()
    assert delta(before, after, 'bcg_serve_dropped_total{reason="timeout"}') == 1  # "too late": never ran
    assert delta(before, after, 'bcg_serve_dropped_total{reason="timeout_running"}') == 1  # the held one: stopped
    assert delta(before, after, 'bcg_serve_requests_total{status="504"}') == 2
    assert delta(before, after, "bcg_serve_images_total") == 0
    assert after["bcg_serve_queue_depth"] == 0
    assert after["bcg_serve_queue_seconds_count"] == before["bcg_serve_queue_seconds_count"] + 1  # "too late" never ran

    # The case: a request for 1,000 steps (the server's --max-steps) times out, and the one
    # after it is answered at once: its call stopped at a step's end instead of running to the last.
    t0 = time.monotonic()
    long = post(brief.url, prompt="a thousand steps", steps=1000)
    assert long.status_code == 504 and BRIEF <= time.monotonic() - t0 < BRIEF + 2
    t1 = time.monotonic()
    short = post(brief.url, prompt="one step", steps=1)
    assert short.status_code == 200 and time.monotonic() - t1 < 5, short.text
    assert "stopped after step" in brief.text() and "of 1000: its request(s) gave up" in brief.text()
    assert brief.client.get("/ready").status_code == 200
    # Every request left one access line: the four posts here, and each /metrics, /ready and /health read.
    lines = [line for line in brief.text().splitlines() if "bcg-serve.access:" in line]
    posts = [re.search(r"POST /v1/images/generations (\d+) ", line) for line in lines]
    assert sorted(m.group(1) for m in posts if m) == ["200", "504", "504", "504"]
    assert len({line.split("id=")[1].split()[0] for line in lines}) == len(lines)  # one line each, ids distinct


def test_a_failed_batch_fails_its_requests_only(server: ServerProcess, pool: Any, tmp_path: Path) -> None:
    release = tmp_path / "go"
    held = hold(server, pool, release)
    doomed = [pool.submit(post, server.url, prompt=p) for p in ("boom", "beside boom")]  # one call
    queued(server, 2)
    fine = pool.submit(post, server.url, prompt="fine", size="64x64")  # another call
    queued(server, 3)
    release.touch()
    assert held.result(60).status_code == 200
    for f in doomed:
        r = f.result(60)
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "generation failed: RuntimeError: injected failure second line"
        assert "\n" not in r.text
    assert fine.result(60).status_code == 200
    assert post(server.url, prompt="still serving").status_code == 200


def test_sigterm_while_busy_finishes_the_running_batch_answers_the_waiting_503_and_exits_0(
    tmp_path: Path, pool: Any
) -> None:
    s = ServerProcess(FLAGS, tmp_path / "server.log", command=HELD)
    try:
        s.wait_ready()
        release = tmp_path / "go"
        held = hold(s, pool, release)
        waiting = [pool.submit(post, s.url, prompt=f"wait {i}", size="64x64") for i in range(3)]
        queued(s, 3)
        s.proc.terminate()
        told = [f.result(60) for f in waiting]  # answered at once, while the held call still runs
        assert [r.status_code for r in told] == [503] * 3
        assert told[0].json()["error"]["code"] == "shutting_down"
        assert not held.done()
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{s.url}/health", timeout=5)
        release.touch()
        r = held.result(60)
        assert r.status_code == 200 and decode(r.json()["data"][0]["b64_json"]).text["prompt"].startswith("hold:")
        assert s.proc.wait(60) == 0
        assert "stopping: 3 waiting request(s) answered 503" in s.text()
    finally:
        s.stop()
