"""bcg-serve --parallel on 2 CPU processes (gloo, the tiny Qwen-Image): rank 0 serves, rank 1 follows.

* A served image with ``--parallel cfg`` is the single-process server's, byte for byte (pixels and
  PNG text), with guidance and without, the CLI's standard (tests/parallel/test_session.py).
* SIGTERM to every rank (what torchrun does) drains rank 0 and ends both with status 0.
* A follower killed, idle or under a call: that request is a 500 saying so, the ones after and
  ``/health`` 503, nothing hangs, and rank 0 exits 1 when stopped.

The ranks are plain processes with torchrun's environment (:func:`tests.helpers.ranks.launch_ranks`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.ranks import launch_ranks
from tests.pipelines.serve.server import ServerProcess

FLAGS = ["--model", "qwen-image", "--device", "cpu", "--resolutions", "64x64", "--batch-sizes", "1", "2",
         "--max-steps", "1000"]  # fmt: skip
WITH_CFG = {"prompt": "a red fox", "size": "64x64", "seed": 3, "steps": 2, "guidance": 4.0,
            "negative_prompt": "blurry"}  # fmt: skip
WITHOUT_CFG = {"prompt": "a cat", "size": "64x64", "seed": 5, "steps": 2, "n": 2}


class Ranks:
    """``bcg-serve --parallel cfg`` with ``flags`` on 2 processes (CPU, else a GPU each), logging to
    ``folder``."""

    def __init__(self, folder: Path, flags: list[str] = FLAGS, cpu: bool = True) -> None:
        script = folder / "serve.py"
        script.write_text("from pipelines.serve import main\nraise SystemExit(main())\n")
        self.folder = folder
        self.procs = launch_ranks(str(script), 2, folder, *flags, "--parallel", "cfg", "--port", "0", cpu=cpu)
        try:
            port = self._port()
        except BaseException:  # no fixture ends them yet
            self.kill()
            raise
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)

    def log(self, rank: int) -> str:
        return (self.folder / f"rank{rank}.log").read_text(errors="replace")

    def _port(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log(0))
            if m:
                return int(m.group(1))
            assert self.procs[0].poll() is None, self.log(0)
            time.sleep(0.05)
        raise AssertionError(f"rank 0 did not say its port:\n{self.log(0)}")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                assert p.poll() is None, f"rank {r} exited {p.returncode}:\n{self.log(r)}"
            if self.client.get("/ready").status_code == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout} s:\n{self.log(0)}")

    def wait(self, rank: int, timeout: float = 60) -> int:
        try:
            return self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {rank} did not exit within {timeout} s:\n{self.log(rank)[-3000:]}") from None

    def kill(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
                p.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    r = Ranks(tmp_path)
    try:
        r.wait_ready()
        yield r
    finally:
        r.kill()


def _images(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [d["b64_json"] for d in response.json()["data"]]


def test_served_images_are_one_process_s_and_sigterm_ends_every_rank(ranks: Ranks, tmp_path: Path) -> None:
    parallel = [_images(ranks.client.post("/v1/images/generations", json=body)) for body in (WITH_CFG, WITHOUT_CFG)]
    for r in ranks.procs:  # as torchrun does: every rank is told
        r.send_signal(signal.SIGTERM)
    assert [ranks.wait(0), ranks.wait(1)] == [0, 0], ranks.log(0)[-3000:] + ranks.log(1)[-3000:]
    assert "rank 1 of 2: stopped after 2 call(s)" in ranks.log(1)

    # One thread, as each rank has (torchrun's OMP_NUM_THREADS=1): a CPU product's bits may depend on
    # how many threads split it.
    single = ServerProcess([*FLAGS], tmp_path / "single.log", env={"OMP_NUM_THREADS": "1"})
    try:
        single.wait_ready()
        alone = [_images(single.generate(**body)) for body in (WITH_CFG, WITHOUT_CFG)]
    finally:
        assert single.stop() == 0, single.text()
    assert [len(x) for x in parallel] == [1, 2]
    assert parallel == alone, "the parallel server's images differ from one process's"


@pytest.mark.parametrize("when", ["idle", "mid-call"])
def test_a_killed_follower_fails_a_request_and_leaves_the_server_unhealthy(ranks: Ranks, when: str) -> None:
    if when == "idle":
        ranks.procs[1].kill()
        ranks.procs[1].wait()
        failed = ranks.client.post("/v1/images/generations", json=WITHOUT_CFG)
        says: tuple[str, ...] = ("a follower rank is gone",)
    else:  # a call of 1000 steps (some 30 s), the follower killed under it: the parallel run's own error
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(ranks.client.post, "/v1/images/generations", json={**WITH_CFG, "steps": 1000})
            time.sleep(2)
            assert not running.done(), running.result().text
            ranks.procs[1].kill()
            failed = running.result()
        # Found at the step's guidance exchange, or at its stop flag, whichever the kill reaches first.
        says = ("lost contact with the other ranks", "a follower rank is gone")
    assert failed.status_code == 500, failed.text
    said = next((s for s in says if s in failed.json()["error"]["message"]), None)
    assert said is not None, failed.text
    after = ranks.client.post("/v1/images/generations", json=WITHOUT_CFG)
    assert after.status_code == 503 and after.json()["error"]["code"] == "ranks_lost", after.text
    health = ranks.client.get("/health")
    assert health.status_code == 503 and said in health.json()["error"]["message"], health.text
    assert ranks.client.get("/ready").status_code == 503
    ranks.procs[0].send_signal(signal.SIGTERM)
    assert ranks.wait(0) == 1
    assert "stopped; it could not serve since: " in ranks.log(0), ranks.log(0)[-3000:]
