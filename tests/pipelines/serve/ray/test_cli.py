"""``bcg-serve --ray`` end to end: the command starts a Ray cluster on the machine, deploys the
application, answers on ``--port`` once a replica has warmed up (a bad request is the frontend's
400, its ``/metrics`` counts the answers), and on SIGTERM deletes it, stops the cluster it started
and exits 0. A replica that cannot start ends the command with its reason in one line, status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.lora_files import make_lora_file
from tests.pipelines.serve.ray.test_ray_app import _free_port
from tests.pipelines.serve.server import ROOT, bcg_serve, decode

pytest.importorskip("ray", reason="the [ray] extra")


FLAGS = ["--ray", "--model", "z-image", "--device", "cpu", "--resolutions", "32x32", "--batch-sizes", "1",
         "--cpus-per-replica", "0"]  # fmt: skip


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([*bcg_serve(), *argv], cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def test_bcg_serve_ray_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    proc = _start([*FLAGS, "--port", str(port)], log)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                if client.get("/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        r = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "32x32", "steps": 1, "seed": 4})
        assert r.status_code == 200, r.text
        assert decode(r.json()["data"][0]["b64_json"]).text["seed"] == "4"
        # Checked at the frontend, as bcg-serve checks it: streams do not cross Ray yet.
        bad = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "32x32", "stream": True})
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "unsupported_stream")
        assert 'bcg_serve_requests_total{status="200"} 1.0' in client.get("/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    text = log.read_text(errors="replace")
    assert f"listening on http://127.0.0.1:{port}" in text and "bcg-serve: stopped" in text


def test_a_replica_that_cannot_start_is_one_line_and_status_1(tmp_path: Path) -> None:
    wide = make_lora_file("z-image", tmp_path / "wide.safetensors", targets=("to_q", "to_k"))
    other = make_lora_file("z-image", tmp_path / "other.safetensors", targets=("to_out.0",))
    log = tmp_path / "serve.log"
    proc = _start([*FLAGS, "--port", str(_free_port()), "--lora", f"wide={wide}", "--lora", f"other={other}"], log)
    try:
        assert proc.wait(300) == 1, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    (line,) = [x for x in log.read_text(errors="replace").splitlines() if "bcg-serve: could not deploy" in x]
    assert f"LoraError: '{other}' cannot be hot-swapped into the adapter slots made from 'wide.safetensors'" in line
