"""A CUDA graph reads the memory it was captured with: the same check the emulator passes
(tests/graphs/test_captured_memory.py), on real graphs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.captured_memory import (
    check_a_capture_keeps_only_what_its_replays_read,
    check_a_replay_reads_the_memory_it_was_captured_with,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_replay_reads_the_memory_it_was_captured_with(dtype: torch.dtype) -> None:
    check_a_replay_reads_the_memory_it_was_captured_with("cuda", dtype)


def test_a_cuda_capture_keeps_only_what_its_replays_read() -> None:
    check_a_capture_keeps_only_what_its_replays_read("cuda")
