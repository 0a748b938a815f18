"""Pipelines that share components share one runner per denoiser; restore is per pipeline.

Users build text-to-image and image-to-image pipelines from one set of weights
(``SomePipeline(**pipe.components)``, ``DiffusionPipeline.from_pipe``); accelerating the second
one used to fail with "Hook with name bcg_graph_runner already exists in the registry".
"""

from __future__ import annotations

import pytest
import torch

import accel.hooks.accelerator as pipeline_mod
from accel import accelerate_pipeline
from accel.hooks.graph_hook import HOOK_NAME, graph_hook_of
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

MODELS = ["z-image", "qwen-image"]


def _latents(pipe, seed: int = 0) -> torch.Tensor:
    return generate(pipe, "a lighthouse on a cliff", negative_prompt="blurry", seed=seed)


@pytest.fixture(params=MODELS)
def pair(request):
    first = build_pipeline(request.param, "tiny")
    second = type(first)(**first.components)
    for p in (first, second):
        p.set_progress_bar_config(disable=True)
    return first, second


def _clean(module: torch.nn.Module) -> bool:
    # A stock call may create an empty registry itself (Qwen-Image's cache_context does).
    registry = getattr(module, "_diffusers_hook", None)
    return "forward" not in module.__dict__ and (registry is None or not registry.hooks)


def test_two_pipelines_share_one_runner_and_restore_per_pipeline(pair) -> None:
    first, second = pair
    module = first.transformer
    reference = _latents(first)
    scheduler_attrs = set(vars(first.scheduler))

    accelerate_pipeline(first)
    accelerate_pipeline(second)  # raised "Hook ... already exists" before
    assert first.accel.runners["transformer"] is second.accel.runners["transformer"]
    assert torch.equal(_latents(second), reference)
    assert torch.equal(_latents(first), reference)

    first.accel.restore()
    assert not hasattr(first, "accel")
    hook = graph_hook_of(module)
    assert hook is not None and hook is second.accel.hooks["transformer"]  # still accelerated for `second`
    assert hasattr(second.scheduler.set_timesteps, "__wrapped__")  # the shared scheduler is still guarded
    assert torch.equal(_latents(second), reference)

    second.accel.restore()
    assert _clean(module)
    assert set(vars(second.scheduler)) == scheduler_attrs  # every shadowed method is gone
    assert torch.equal(_latents(first), reference)


def test_from_pipe_shares_and_other_options_are_refused() -> None:
    first = build_pipeline("z-image", "tiny")
    accelerate_pipeline(first)
    second = type(first).from_pipe(first)
    assert second.transformer is first.transformer
    accelerate_pipeline(second)
    assert second.accel.runners["transformer"] is first.accel.runners["transformer"]
    third = type(first).from_pipe(first)
    with pytest.raises(ValueError, match=r"already accelerated by another pipeline.*max_entries=4 \(in use: 32\)"):
        accelerate_pipeline(third, max_entries=4)
    assert "accel" not in vars(third)
    second.accel.restore()
    first.accel.restore()
    assert _clean(first.transformer)


def test_hook_installs_and_undoes_its_recipe_in_its_own_lifecycle() -> None:
    pipe = build_pipeline("z-image", "tiny")
    module = pipe.transformer
    accelerate_pipeline(pipe)
    registry = module._diffusers_hook
    assert "_pad_with_ids" in vars(module)  # the Z-Image recipe's per-instance patch
    registry.remove_hook(HOOK_NAME, recurse=False)  # diffusers' own removal runs deinitalize_hook
    assert "_pad_with_ids" not in vars(module)


def test_cpu_says_once_and_visibly_that_graphs_are_off(caplog, monkeypatch) -> None:
    monkeypatch.setattr(pipeline_mod, "_said_no_cuda", False)
    with caplog.at_level("WARNING", logger="accel"):
        for _ in range(2):
            pipe = build_pipeline("z-image", "tiny")
            accelerate_pipeline(pipe)
    lines = [r for r in caplog.records if "CUDA graphs are off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert "CUDA is not available" in lines[0].getMessage()
    assert "no graphs: CUDA is not available" in pipe.accel.report()
