"""A real server process for the tests: started on a free loopback port, talked to over HTTP.

:class:`ServerProcess` starts ``bcg-serve`` (or :mod:`tests.pipelines.serve.held_server`, the
same server with its pipeline's call wrapped) with ``--port 0``, reads the port the server
logs, waits for ``/ready``, and reads ``/metrics``. Its log goes to a file, so a full pipe never
blocks the server.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--resolutions", "64x64", "32x32", "--device", "cpu"]


def bcg_serve() -> list[str]:
    """The installed ``bcg-serve`` beside this Python, else ``python -m pipelines.serve``."""
    script = Path(sys.executable).with_name("bcg-serve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pipelines.serve"]


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


class ServerProcess:
    def __init__(
        self, argv: list[str], log: Path, command: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([*(command or bcg_serve()), *argv, "--port", "0"], cwd=ROOT, env=env,
                                     stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        self.url = f"http://127.0.0.1:{self._port()}"
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _port(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.text())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"the server did not say its port:\n{self.text()}")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.text()}")
            if self.client.get("/ready").status_code == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.text()}")

    def metrics(self) -> dict[str, float]:
        """Every sample, keyed ``name{label="value",...}`` (labels sorted) or ``name``."""
        out = {}
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def generate(self, **body: Any) -> httpx.Response:
        return self.client.post("/v1/images/generations", json=body)

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self, timeout: float = 60) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def make_lora(folder: Path, model: str = "z-image", name: str = "style.safetensors") -> Path:
    """A LoRA file for the tiny ``model``'s transformer (its attention projections, random
    weights, so it visibly changes the images), written as diffusers' ``save_lora_weights`` does."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from pipelines.builders import build_pipeline

    pipe = build_pipeline(model, size="tiny", seed=0)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    pipe.transformer.add_adapter(config)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                                 weight_name=name)  # fmt: skip
    return folder / name
