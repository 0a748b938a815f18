"""Every tiny zoo family on a real GPU with the library's defaults, decoded: the breadth test of
tests/pipelines/test_zoo_graphs.py without the emulator, so the pageable copies only CUDA refuses
(Chroma's, CogView4's) are found here, and the VAE's graphs are in the compared image (Wan's causal
VAE keeps a per-call cache in a list it is handed: a captured decoder would repeat the first frame).

Each family: the stock pipeline's decoded output, then ``accelerate_pipeline(pipe)``, its warm-up
the family's way, and the same call twice (replays after a warm call): bit for bit equal, replays
and no eager calls in the denoiser.
"""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.recipes.recipe import WARMUP_ARGUMENTS
from pipelines import zoo

pytestmark = pytest.mark.cuda
DEV = "cuda"
# Qwen-Image-Edit resizes its input image to a megapixel at any size: its VAE dominates, and
# Qwen-Image's own recipe is tested in test_accelerator.py.
FAMILIES = [n for n in zoo.NAMES if n != "qwen-image-edit"]


def _decoded(pipe, kwargs: dict) -> torch.Tensor:
    out = pipe(**kwargs, output_type="pt", generator=torch.Generator(DEV).manual_seed(0))
    return (out.frames if getattr(out, "images", None) is None else out.images).clone()


@pytest.mark.parametrize("name", FAMILIES)
def test_graphs_by_default_equal_eager_decoded(name: str) -> None:
    pipe = zoo.build(name, "tiny", device=DEV)
    family = zoo.family(name)
    kwargs = zoo.call_kwargs(name, "tiny", device=DEV, steps=3)
    want = _decoded(pipe, kwargs)
    accelerate_pipeline(pipe)
    given = {k: v for k, v in zoo.call_inputs(name, "tiny", device=DEV).items() if k not in WARMUP_ARGUMENTS}
    geo = family.geometry["tiny"]
    frames = {"num_frames": geo.frames} if geo.frames else {}
    pipe.accel.warmup([(geo.width, geo.height)], cfg=family.cfg, call_kwargs=given, progress=False, **frames)
    for _ in range(2):
        got = _decoded(pipe, kwargs)
        assert torch.equal(got, want), f"max diff {(got - want).abs().max()}\n{pipe.accel.report()}"
    denoiser = next(st for n, st in pipe.accel.stats().items() if n in ("transformer", "unet"))
    assert denoiser.replays > 0 and denoiser.misses == 0 and denoiser.eager_calls == 0, pipe.accel.report()
