"""``bcg-serve`` with CUDA graphs emulated on the CPU (tests/helpers/emulator.py), so a real server
process warms up, captures its buckets and replays them as on a GPU: started as
``python -m tests.pipelines.serve.emulated_server [bcg-serve flags]``.

Where ``BCG_TEST_WARMUP_GATE`` names a file, the warm-up waits until that file exists (at most
120 s), so a test can see the server before it is ready. Everything else is the real server.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipelines.serve import warmup
from tests.helpers.emulator import emulate_pipelines

GATE = "BCG_TEST_WARMUP_GATE"
_warm_up = warmup.warm_up


@functools.wraps(_warm_up)
def _gated_warm_up(*args: Any, **kwargs: Any) -> Any:
    gate = os.environ.get(GATE)
    deadline = time.monotonic() + 120
    while gate and not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _warm_up(*args, **kwargs)


if __name__ == "__main__":
    import torch

    from pipelines.serve import main

    # Tiny models: a second thread only fights the others over the cores (on a loaded 2-core
    # machine the warm-up took 80 s with two, against a few seconds with one).
    torch.set_num_threads(1)
    emulate_pipelines(pytest.MonkeyPatch())  # undone only when the process ends
    warmup.warm_up = _gated_warm_up  # startup imports it from the module when the worker starts
    sys.exit(main())
