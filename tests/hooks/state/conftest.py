"""What every test of the guard, LoRA and the state matrix runs under: emulated CUDA graphs, one
CPU thread, and diffusers' process-wide attention backend given back afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from tests.helpers.emulator import emulate_pipelines


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    emulate_pipelines(monkeypatch)
    # set_attention_backend sets diffusers' process-wide backend too: given back after the test.
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only fight over the cores
    yield monkeypatch
    torch.set_num_threads(threads)
