"""Breaks found at capture on a real GPU, for a model run without its recipe.

A module of its own: the Qwen-Image recipe marks the text-mask helper process-wide while any
accelerated Qwen-Image pipeline lives, and another module's pipeline fixture would hide the very
failure this test needs the stock forward to hit.
"""

from __future__ import annotations

import pytest
import torch

from accel.graphs.runner import GraphRunner
from tests.cuda.test_qwen_image import _call_kwargs, _small_qwen

pytestmark = pytest.mark.cuda


@torch.no_grad()
def test_qwen_image_transformer_with_a_mask_is_captured_through_a_found_break() -> None:
    # diffusers' Qwen-Image transformer, run without its recipe: its text-mask helper copies a
    # host value to the device (a pageable copy), so the stock forward cannot be captured whole.
    model = _small_qwen()
    runner = GraphRunner(model, name="qwen-auto", auto_breaks=True)
    assert runner.capture(**_call_kwargs(16, 16, 32, 20, seed=0)), runner.blocked
    print("\nqwen-image transformer breaks found: " + "; ".join(map(str, runner.found_breaks)))
    assert runner.found_breaks and all(s.filename and s.lineno > 0 for s in runner.found_breaks)
    for seed in range(1, 6):
        kw = _call_kwargs(16, 16, 32, 10 + seed, seed=seed)  # mask values change, shape does not
        assert torch.equal(runner(**kw)[0], model(**kw)[0]), f"seed {seed}"
    assert runner.stats().replays == 5
    runner.release()
    runner.unmark()
    # Given back: the stock forward fails to capture again.
    again = GraphRunner(model, name="qwen-stock")
    assert not again.capture(**_call_kwargs(16, 16, 32, 20, seed=0))
    assert "at " in next(iter(again.blocked.values()))  # the failure is named even without auto_breaks
