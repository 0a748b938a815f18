"""Processes: one, or those of an accelerate launch, and which one this is."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

logger = logging.getLogger("bcg-generate")


@dataclasses.dataclass
class Processes:
    index: int = 0
    count: int = 1
    device: Any = None  # this process's device under accelerate
    state: Any = None

    @property
    def tag(self) -> str:
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
