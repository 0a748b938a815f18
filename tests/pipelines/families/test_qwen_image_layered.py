"""Qwen-Image Layered (``QwenImageLayeredPipeline``) under graphs, on tiny pipelines and emulated CUDA
graphs that refuse pageable copies as a GPU does (tests/helpers/after_warmup.py), and as the
front ends run it: ``bcg-generate`` writes every layer of every image as an RGBA file of its own,
and ``bcg-serve``'s ``/v1/images/edits`` answers each as a ``data`` item, equal to the pipeline's.

The documented warm-up (``pipe.accel.warmup([(w, h)], prompts=[...])``: ``(w, h)`` the input
image's size, the text at its exact length) raises nothing; after it, calls with those prompts and
other seeds, for two image sizes in shuffled order, replay every denoiser step, never run it
eagerly, and equal the stock pipeline bit for bit; the text encoder keeps the graphs its warm-up
captured. The pipeline makes its layers at 640 or 1024 pixels a side, minutes of a tiny VAE on a
CPU: its size rule is scaled down for the stock and the accelerated pipeline alike
(tests/helpers/small_layers.py), which changes no code path.
"""

from __future__ import annotations

import random

import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as layered_pipeline
from PIL import Image

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image import layered
from tests.helpers.after_warmup import as_on_cuda, assert_replayed_only, counts
from tests.helpers.small_layers import shrink_layers

pytestmark = pytest.mark.usefixtures("few_threads")

PROMPTS = ["a red fox in the snow", "a lighthouse on a cliff at night, waves breaking on the rocks below it", "tea"]
NEGATIVE = "blurry"
IMAGES = [(64, 48), (48, 64)]  # input image sizes (width, height)
LAYERS = 2


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    as_on_cuda(monkeypatch)
    shrink_layers(monkeypatch)


def _pipe():
    pipe = build_pipeline("qwen-image-layered", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = torch.randint(0, 256, (size[1], size[0], 4), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy(), mode="RGBA")


def _call(pipe, prompt: str, seed: int, size: tuple[int, int], cfg: bool) -> list[torch.Tensor]:
    return pipe(
        image=_image(size, seed),
        prompt=prompt,
        negative_prompt=NEGATIVE if cfg else None,
        true_cfg_scale=4.0 if cfg else 1.0,
        layers=LAYERS,
        num_inference_steps=3,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
    ).images


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_documented_warmup_then_every_step_replays_bit_for_bit(graphs, cfg: bool) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe)
    pipe.accel.warmup(
        IMAGES, cfg=cfg, prompts=PROMPTS, negative_prompt=NEGATIVE, call_kwargs=dict(layers=LAYERS), progress=False
    )
    before = counts(pipe)
    runs = [(p, 10 + i, size) for i, p in enumerate(PROMPTS) for size in IMAGES]
    random.Random(0).shuffle(runs)
    for prompt, seed, size in runs:
        got, want = _call(pipe, prompt, seed, size, cfg), _call(stock, prompt, seed, size, cfg)
        assert len(got) == len(want) == 1 and torch.equal(got[0], want[0]), (prompt, size)
        assert got[0].shape[0] == LAYERS
        assert tuple(got[0].shape[-2:]) == layered.output_size(*size, 640)[::-1]  # (height, width)
    assert_replayed_only(before, counts(pipe), pipe.accel.report())
    assert "the stock pipeline's, bit for bit" in pipe.accel.report()


def test_warmup_without_prompts_or_call_kwargs_raises_nothing(graphs) -> None:
    pipe = _pipe()
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup([(64, 48)], progress=False)
    assert report.total_captures > 0
    stats = pipe.accel.stats()["transformer"]
    assert stats.capture_failures == 0 and stats.entries > 0


@pytest.mark.parametrize(
    "call_kwargs, message",
    [
        (dict(resolution=512), "resolution must be 640 or 1024, got 512"),
        (dict(layers=0), "layers must be a positive integer, got 0"),
    ],
)
def test_a_call_the_pipeline_cannot_run_is_refused_in_one_line(call_kwargs, message: str) -> None:
    pipe = _pipe()
    accelerate_pipeline(pipe)
    with pytest.raises(ValueError, match=message):
        pipe.accel.warmup([(64, 48)], call_kwargs=call_kwargs, progress=False)


@pytest.mark.parametrize("size", [(64, 48), (1920, 1080), (1000, 1000), (333, 1000)])
@pytest.mark.parametrize("resolution", layered.RESOLUTIONS)
def test_output_size_is_the_pipelines(size: tuple[int, int], resolution: int) -> None:
    width, height = layered_pipeline.calculate_dimensions(resolution * resolution, size[0] / size[1])
    assert layered.output_size(*size, resolution) == (width // 16 * 16, height // 16 * 16)


def test_the_layered_denoiser_and_pipeline_are_told_apart() -> None:
    pipe = _pipe()
    assert layered.is_layered(pipe.transformer) and layered.is_layered_pipeline(pipe)
    qwen = build_pipeline("qwen-image", "tiny")
    assert not layered.is_layered(qwen.transformer) and not layered.is_layered_pipeline(qwen)


def test_the_cli_hands_the_layered_pipeline_an_rgba_image() -> None:
    """Its VAE reads four channels: ``bcg-generate --image`` keeps an input image's alpha for it
    (an RGB file gets an opaque one) where other pipelines get the image flattened to RGB."""
    from pipelines.generation.image_input import flatten

    rgba, rgb = _image((64, 48), 0), _image((64, 48), 1).convert("RGB")
    pipe, other = _pipe(), build_pipeline("qwen-image", "tiny")
    assert flatten(rgba, pipe).mode == flatten(rgb, pipe).mode == "RGBA"
    assert flatten(rgba, pipe).tobytes() == rgba.tobytes()
    assert flatten(rgba, other).mode == flatten(rgba).mode == "RGB"
