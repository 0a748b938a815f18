"""Processes: one, or those of an accelerate launch or torchrun, and which one this is.

Both front ends read it: ``bcg-generate`` shares its jobs out (or, with ``--parallel``, makes
every image on every process), ``bcg-serve --parallel`` serves from rank 0 while the other ranks
follow its calls."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from .errors import InputError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Processes:
    """This process's ``index`` among ``count``, its ``device`` and accelerate's ``state`` (None alone)."""

    index: int = 0
    count: int = 1
    device: Any = None  # this process's device under accelerate
    state: Any = None

    @property
    def tag(self) -> str:
        """The rank, as a log line's prefix (nothing for one process)."""
        return f"[rank {self.index}/{self.count}] " if self.count > 1 else ""


def detect_processes(cpu: bool) -> Processes:
    """accelerate's PartialState when launched with several processes, else a single process.

    ``cpu``: the processes run on the CPU (gloo) rather than one GPU each. accelerate only
    starts several CPU processes through torchrun (``accelerate launch --multi_gpu`` on a
    machine without GPUs) or mpirun; ``--cpu`` alone starts one.
    """
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        world, rank = 1, 0
    if world <= 1:
        return Processes()
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    if state.num_processes != world:  # never split wrongly: the launcher's numbers decide
        logger.warning("accelerate sees %d process(es), the launcher started %d", state.num_processes, world)
        return Processes(rank, world, None, None)
    return Processes(state.process_index, state.num_processes, state.device, state)


def check_parallel(parallel: str | None, procs: Processes) -> None:
    """InputError where ``--parallel`` was given to a process that runs alone."""
    if parallel is not None and procs.count < 2:
        raise InputError(
            f"--parallel {parallel} computes each image on several processes: start this with accelerate launch "
            "--num_processes 2 (or torchrun --nproc_per_node 2)"
        )
