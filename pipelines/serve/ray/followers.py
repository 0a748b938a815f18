"""A replica of several processes (``--ray --parallel``): the replica is rank 0 and starts the others.

Ray gives the replica's actor its GPUs (``num_gpus``, its ``CUDA_VISIBLE_DEVICES``); the replica
starts one ``bcg-serve`` process per other GPU, each with the environment torchrun would give it
(rank, world size, a free port on loopback), so that rank ``k`` computes on the replica's GPU
``k`` and follows rank 0's calls (:func:`pipelines.serve.ranks.follow`). The replica's health
fails once one of them has exited; its stop waits for them to end (rank 0 tells them to when
its device worker is done) and kills those that do not.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Followers"]

logger = logging.getLogger("bcg-serve")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Followers:
    """Ranks 1 to ``world - 1`` of a replica, started with bcg-serve's flags ``argv``; this
    process's environment made rank 0's (read when it joins them: :func:`pipelines.serve.ranks.join`)."""

    def __init__(self, argv: Sequence[str], world: int) -> None:
        import pipelines

        launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
                  "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
        os.environ.update(launch, RANK="0", LOCAL_RANK="0")
        # The project's folder first, so a follower imports the same code as this process.
        root = str(Path(pipelines.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world):
            env = {**os.environ, **launch, "RANK": str(rank), "LOCAL_RANK": str(rank), "PYTHONPATH": path}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "pipelines.serve", *argv], env=env))
        logger.info("started %d follower rank(s) (pids %s)", world - 1, " ".join(str(p.pid) for p in self.procs))

    def gone(self) -> str | None:
        """Which follower has exited, and how, in a few words; None while all run."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"follower rank {rank} exited with status {p.returncode}"
        return None

    def stop(self, grace: float) -> None:
        """Wait ``grace`` seconds for the followers to exit (rank 0 told them to), then kill the rest."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
