"""Start a test file again as N worker processes with the environment torchrun gives its workers:
the multi-process tests share this. CPU workers (the default) get gloo, no GPU and one thread
each; GPU workers (``cpu=False``) keep the devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script: str, world: int, out: Path, *args: str, cpu: bool = True) -> list[subprocess.Popen]:
    """``python script *args`` once per rank; each rank's output goes to ``out/rank{r}.log``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        if cpu:
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs
