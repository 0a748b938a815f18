"""The state matrix (tests/helpers/state_matrix.py) on emulated graphs: every change a user makes
after a capture gives what ``report()`` promises, on both models, with exact options and with the
defaults. The GPU twin is tests/cuda/test_state_matrix.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers import state_matrix
from tests.helpers.generate import generate

pytest.importorskip("peft")

# Qwen-Image's exact options; Z-Image's defaults are exact.
CASES = [("qwen-image", {"text_buckets": None, "cfg_batch": False}), ("qwen-image", {}), ("z-image", {})]


def _pipe(name: str) -> Any:
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return generate(pipe, negative_prompt="blurry", guidance=4.0, steps=2, seed=3)


def _eager(pipe: Any) -> torch.Tensor:
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        return _call(pipe)
    finally:
        runner.enabled = True


@pytest.mark.parametrize(
    ("name", "options"), CASES, ids=lambda c: str(c) if isinstance(c, str) else str(c or "defaults")
)
@torch.no_grad()
def test_every_change_after_a_capture_gives_what_the_report_promises(name: str, options: dict, emulated) -> None:
    pipe, stock = _pipe(name), _pipe(name)
    accelerate_pipeline(pipe, capture_on_miss=True, **options)
    assert torch.equal(_call(pipe), _call(stock))
    results = state_matrix.run(pipe, stock, state_matrix.Setup(name), _call, _eager)
    assert not any(r.off for r in results), state_matrix.table(results)
    # On the CPU nothing is padded, so every row is held to the stock pipeline.
    assert all(r.claim == "stock, bit for bit" for r in results)
    assert sum(r.captures for r in results) > 0
    pipe.accel.restore()
