"""cfg_batch on a full-size Qwen-Image pipeline (random weights, bf16): true CFG's two denoiser
calls run as one call at batch 2 where the text is padded (up to 768x768).

The reference for the graphs is the same joined call run eagerly (mode="debug"): bit for bit,
in shuffled order with allocator churn. The distance to the two calls run separately (graphs,
cfg_batch=False) is printed and bounded like the text buckets' distance to stock.
"""

from __future__ import annotations

import random

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.cfg_batch import cfg_batch_hook_of
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda

RESOLUTIONS = [(512, 512), (768, 512)]
PROMPTS = ["a red fox in fresh snow at dawn", "an isometric cutaway of a tiny underground library lit by lanterns"]
NEGATIVE = "blurry, low quality"
STEPS = 4


def _call(pipe, prompt: str, wh, seed: int) -> torch.Tensor:
    # Qwen-Image: true_cfg_scale
    return generate(
        pipe, prompt, size=wh, steps=STEPS, negative_prompt=NEGATIVE, guidance=4.0, seed=seed, device="cuda"
    )


@torch.no_grad()
def test_joined_branches_replay_exactly_and_stay_near_separate_calls() -> None:
    pipe = build_pipeline("qwen-image", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    cases = [(p, wh, s) for p in PROMPTS for wh in RESOLUTIONS for s in (0, 1)]

    accelerate_pipeline(pipe, cfg_batch=False)
    assert cfg_batch_hook_of(pipe.transformer) is None
    pipe.accel.warmup(RESOLUTIONS, prompts=PROMPTS, negative_prompt=NEGATIVE, progress=False)
    separate = {case: _call(pipe, *case) for case in cases}

    accelerate_pipeline(pipe, mode="debug")  # joined, run eagerly through the runner
    joined_eager = {case: _call(pipe, *case) for case in cases}

    accelerate_pipeline(pipe)  # joined, graphs
    report = pipe.accel.warmup(RESOLUTIONS, prompts=PROMPTS, negative_prompt=NEGATIVE, progress=False)
    print(f"\nqwen-image cfg_batch warmup:\n{report}")
    hook = cfg_batch_hook_of(pipe.transformer)
    assert hook is not None
    st0, joined0 = pipe.accel.stats()["transformer"], hook.joined
    random.Random(0).shuffle(cases)
    worst = 0.0
    for i, case in enumerate(cases):
        out = _call(pipe, *case)
        assert torch.equal(out, joined_eager[case]), f"{case[1]} seed {case[2]}: graphs differ from the joined call"
        ref = separate[case].float()
        worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
        if i == len(cases) // 2:
            torch.cuda.empty_cache()  # allocator churn between replays
            junk = [torch.randn(1 << 20, device="cuda") for _ in range(16)]
            del junk
    st = pipe.accel.stats()["transformer"]
    print(pipe.accel.report())
    print(f"qwen-image joined vs separate calls, worst max-abs diff relative to max |latent|: {worst:.2e}")
    assert hook.joined - joined0 == STEPS * len(cases) and hook.alone == 0
    assert st.captures == st0.captures and st.misses == 0 and st.eager_calls == 0
    # One graph per resolution serves both branches.
    assert st.replays - st0.replays == STEPS * len(cases)
    assert worst < 0.05
    pipe.accel.restore()
    assert cfg_batch_hook_of(pipe.transformer) is None
