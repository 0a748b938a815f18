"""Two pipelines built from one set of weights share the denoiser's graphs; both equal eager."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda


def _call(pipe, name: str, wh=(128, 128), seed: int = 0) -> torch.Tensor:
    return generate(pipe, size=wh, steps=3, negative_prompt="blurry", guidance=4.0, seed=seed, device="cuda")


@pytest.mark.parametrize("name", ["z-image", "qwen-image"])
@torch.no_grad()
def test_two_pipelines_sharing_a_transformer_both_equal_eager(name: str) -> None:
    first = build_pipeline(name, "tiny", device="cuda", dtype=torch.bfloat16, seed=0)
    first.set_progress_bar_config(disable=True)
    second = type(first).from_pipe(first)
    second.set_progress_bar_config(disable=True)
    refs = {(wh, s): _call(first, name, wh, s) for wh in [(128, 128), (192, 128)] for s in (0, 1)}

    accelerate_pipeline(first, text_buckets=None)
    accelerate_pipeline(second, text_buckets=None)
    runner = first.accel.runners["transformer"]
    assert runner is second.accel.runners["transformer"]
    first.accel.warmup(
        [(128, 128), (192, 128)], prompts=["a lighthouse in a storm"], negative_prompt="blurry", progress=False
    )
    captures = runner.stats().captures
    assert captures > 0
    for (wh, s), ref in refs.items():
        for pipe in (second, first):
            assert torch.equal(_call(pipe, name, wh, s), ref), f"{name} {wh} seed {s}"
    st = runner.stats()
    assert st.captures == captures and st.misses == 0 and st.replays > 0  # second used the first's graphs

    first.accel.restore()  # second keeps its graphs
    assert torch.equal(_call(second, name, (128, 128), 0), refs[((128, 128), 0)])
    assert runner.stats().replays > st.replays
    second.accel.restore()
    assert torch.equal(_call(first, name, (128, 128), 1), refs[((128, 128), 1)])
