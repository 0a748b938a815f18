"""After warm-up, the denoiser's calls read no tensor values on the host at every step
(tests/helpers/host_reads.py says why that counts on a GPU), as on a GPU (the emulator, the
recipes' per-call routing on): a call of 4 steps reads no more than one of 2 steps, whatever it
reads once per pipeline call (Qwen-Image 2.1's masks, before the runner). The families that still
read at every call are listed with the reason, and their count is pinned, so a change shows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from tests.helpers.after_warmup import as_on_cuda, tiny
from tests.helpers.host_reads import count_host_reads

# Reads at every denoiser call, and why: Qwen-Image's block modulation is reused by the second
# guidance call only at the same timestep values, read on the host before the runner
# (pipelines/families/qwen_image/modulation.py); one per call.
PER_CALL = {"qwen-image": 1}
FAMILIES = ["z-image", "qwen-image", "qwen-image-2.1"]


def _run(pipe: Any, steps: int) -> None:
    pipe(prompt="a fox in the snow", height=64, width=64, num_inference_steps=steps, output_type="latent",
         generator=torch.Generator().manual_seed(0))  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_a_replayed_call_reads_nothing_at_every_step(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    as_on_cuda(monkeypatch, host_copies=False)
    pipe = tiny(name)
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(64, 64)], prompts=["a fox in the snow"], progress=False)
    counts = []
    for steps in (2, 4):
        with count_host_reads(pipe.transformer) as reads:
            _run(pipe, steps)
        counts.append(sum(reads.values()))
    st = pipe.accel.stats()["transformer"]
    assert st.replays > 0 and st.eager_calls == 0, st
    extra = counts[1] - counts[0]
    assert extra == 2 * PER_CALL.get(name, 0), f"{name}: {counts} reads in calls of 2 and 4 steps: {dict(reads)}"
