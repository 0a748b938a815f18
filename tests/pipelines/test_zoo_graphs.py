"""Every tiny zoo family under emulated CUDA graphs (tests/helpers/emulator.py) with the library's
defaults: warmed up as its call signature says, then a real call replays graphs and equals the
stock pipeline bit for bit. Functions that break a capture (HiDream's host reads, Lumina2's
``tolist()``) become eager breaks by default. The emulator refuses host reads as CUDA does, but
not pageable host-to-device copies (Chroma's, CogView4's): those are found on a GPU only."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.recipes.recipe import WARMUP_ARGUMENTS
from pipelines import zoo
from tests.helpers.emulator import emulate_pipelines

# Qwen-Image-Edit resizes its image to a megapixel even at the tiny size: tens of seconds here.
FAMILIES = [n for n in zoo.NAMES if n != "qwen-image-edit"]


def _latents(pipe, kwargs: dict) -> torch.Tensor:
    out = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0))
    return out.frames if getattr(out, "images", None) is None else out.images


@pytest.mark.parametrize("name", FAMILIES)
def test_graphs_by_default_equal_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_pipelines(monkeypatch)
    pipe = zoo.build(name, "tiny")
    family = zoo.family(name)
    kwargs = zoo.call_kwargs(name, "tiny", steps=2)
    want = _latents(pipe, kwargs)
    accelerate_pipeline(pipe)
    given = {k: v for k, v in zoo.call_inputs(name, "tiny").items() if k not in WARMUP_ARGUMENTS}
    geo = family.geometry["tiny"]
    frames = {"num_frames": geo.frames} if geo.frames else {}
    pipe.accel.warmup([(geo.width, geo.height)], cfg=family.cfg, call_kwargs=given, progress=False, **frames)
    got = _latents(pipe, kwargs)
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}\n{pipe.accel.report()}"
    denoiser = next(st for n, st in pipe.accel.stats().items() if n in ("transformer", "unet"))
    assert denoiser.replays > 0 and denoiser.misses == 0 and denoiser.eager_calls == 0, pipe.accel.report()
    if name in ("hidream", "lumina2"):
        assert any(segments > 1 for segments in denoiser.segments_per_entry)  # a found break
    if name == "lumina2":
        # Its found break's outputs take their shapes from the caption mask: the guidance branches'
        # captions differ in length, so each gets a chain of its own.
        assert sorted(map(len, denoiser.paths_per_entry)) == [2]
