"""The state matrix (tests/helpers/state_matrix.py) on real CUDA graphs, on both models: after
every change a user makes to a loaded pipeline, the next call gives what ``report()`` promises,
the stock image bit for bit where it says so, and otherwise exactly the same accelerated pipeline
run eagerly (so a recapture is as exact as the first capture). The CPU twin is
tests/hooks/state/test_state_matrix.py; a GPU log is in samples/gpu-run-2026-12-06/."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers import state_matrix
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda
pytest.importorskip("peft")

DEV = "cuda"
PROMPT = "a lighthouse in a storm"
# Qwen-Image's exact options, then the defaults (text buckets, joined guidance: not claimed
# exact, held to their own eager run, until a processor refuses the mask); Z-Image's defaults are exact.
CASES = [
    ("qwen-image", {"text_buckets": None, "cfg_batch": False}),
    ("qwen-image", {}),
    ("z-image", {}),
]


@pytest.fixture(autouse=True)
def backend_given_back() -> Iterator[None]:
    """set_attention_backend sets diffusers' process-wide backend too: given back after each test."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active


def _pipe(name: str) -> Any:
    pipe = build_pipeline(name, "tiny", device=DEV, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return generate(pipe, PROMPT, size=(128, 128), steps=3, seed=0, device=DEV, guidance=4.0, negative_prompt="blurry")


def _eager(pipe: Any) -> torch.Tensor:
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        return _call(pipe)
    finally:
        runner.enabled = True


@pytest.mark.parametrize(("name", "options"), CASES, ids=["qwen-image-exact", "qwen-image-defaults", "z-image"])
@torch.no_grad()
def test_every_change_after_a_capture_gives_what_the_report_promises(name: str, options: dict, capsys) -> None:
    pipe, stock = _pipe(name), _pipe(name)
    accelerate_pipeline(pipe, capture_on_miss=True, **options)
    pipe.accel.warmup((128, 128), prompts=[PROMPT], negative_prompt="blurry", progress=False)
    first = _call(pipe)
    exact = state_matrix.EXACT_LINE in pipe.accel.report()
    want = _call(stock) if exact else _eager(pipe)
    diff_to_stock = float((first.float() - _call(stock).float()).abs().max())
    results = state_matrix.run(pipe, stock, state_matrix.Setup(name, DEV, torch.bfloat16), _call, _eager)
    with capsys.disabled():
        print(
            f"\n{name} {options or 'defaults'}: the first call, {'exact' if exact else 'not claimed exact'}, "
            f"{diff_to_stock:.3g} max off the stock call"
        )
        print(state_matrix.table(results))
    assert torch.equal(first, want)
    assert not any(r.off for r in results), state_matrix.table(results)
    if name == "qwen-image" and not options:
        # A processor that drops the mask switches padding off: from there on held to stock.
        claims = [r.claim for r in results]
        assert claims[0] == "its own eager run" and "stock, bit for bit" in claims
    else:
        assert exact and all(r.claim == "stock, bit for bit" for r in results)
    pipe.accel.restore()
