"""The emulator models what a real graph reads: memory, not tensor objects (the GPU twin is
tests/cuda/test_captured_memory.py)."""

from __future__ import annotations

import pytest

from tests.helpers.captured_memory import (
    check_a_capture_keeps_only_what_its_replays_read,
    check_a_replay_reads_the_memory_it_was_captured_with,
)
from tests.helpers.emulator import emulate_cuda


def test_an_emulated_replay_reads_the_memory_it_was_captured_with(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_cuda(monkeypatch)
    check_a_replay_reads_the_memory_it_was_captured_with("cpu")


def test_an_emulated_capture_keeps_only_what_its_replays_read(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_cuda(monkeypatch)
    check_a_capture_keeps_only_what_its_replays_read("cpu")
