"""Fixtures the server's CPU tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.helpers.emulator import emulate_pipelines


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """CUDA graphs emulated on the CPU for every pipeline, on one torch thread."""
    emulate_pipelines(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only fight over the cores
    yield monkeypatch
    torch.set_num_threads(threads)
