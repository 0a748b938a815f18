"""``compile=True`` on the CPU, under emulated graphs, with a backend that counts what dynamo compiles.

``compile=True`` needs CUDA; here the library's own compile path runs on the CPU instead: the blocks
are compiled by dynamo with :class:`torch._dynamo.testing.CompileCounter` as the backend (the traced
FX graph run as it is, so its aten ops reach the emulator's recorder and replay like any others),
and the emulated capture's dispatch mode is declared infrastructure, which dynamo traces under (as
it does under CUDA's capture). What dynamo compiles and recompiles, and why, is what it would do on
a GPU for the same shapes; inductor's kernels are not involved.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from accel.hooks.compiled import compile as compile_mod
from tests.helpers import emulator


def compile_on_cpu(monkeypatch: pytest.MonkeyPatch) -> CompileCounter:
    """Let ``compile=True`` compile on the CPU (call after ``emulate_pipelines``); the counter
    of frames dynamo compiled from now on. Dynamo's caches are reset here; reset them again when
    the test ends (compiled code holds the modules it was compiled for)."""
    counter = CompileCounter()
    monkeypatch.setattr(compile_mod, "why_not_compiled", lambda module: None)
    monkeypatch.setattr(compile_mod, "COMPILE_OPTIONS", dict(fullgraph=True, dynamic=True, backend=counter))
    # The emulator says CUDA is there, so dynamo would save and restore CUDA's RNG state per frame.
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(emulator._Recorder, "is_infra_mode", classmethod(lambda cls: True), raising=False)
    torch._dynamo.reset()
    return counter
