"""Z-Image Omni and Qwen-Image Layered under real CUDA graphs (their CPU twins, under emulated
graphs: tests/pipelines/families/test_z_image_omni.py and test_qwen_image_layered.py).

* The omni mode's ``torch.tensor(list, device="cuda")`` (``_prepare_sequence``,
  ``_build_unified_sequence``) is a pageable host-to-device copy: without the recipe's omni
  handling (and found breaks off) the capture fails on the GPU; with it nothing fails.
* Tiny Omni (text-to-image and with a condition image) and tiny Layered pipelines: after the
  documented warm-up every step replays, nothing runs eagerly, decoded images equal the stock
  pipeline's bit for bit.
* Full-size Z-Image Omni at 1024x1024, decoded, eager beside graphs in one process: bit for bit.
  Heavy (10B of random weights, ~25 GB in bf16): the last test of the module.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from pipelines.families.z_image import omni

pytestmark = pytest.mark.cuda
DEV = "cuda"
PROMPTS = ["a red fox in the snow", "a lighthouse on a cliff at night, waves breaking on the rocks below it", "tea"]


def _image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    pixels = torch.randint(0, 256, (height, width, channels), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy(), mode=mode)


def _omni(size: str = "tiny"):
    pipe = build_pipeline("z-image-omni", size, device=DEV, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _omni_call(pipe, prompt: str, seed: int, size: tuple[int, int], steps: int = 3, **extra) -> torch.Tensor:
    return pipe(
        prompt=prompt,
        width=size[0],
        height=size[1],
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator(DEV).manual_seed(seed),
        **extra,
    ).images


def _after_warmup_only_replays(pipe, before) -> None:
    stats = pipe.accel.stats()
    den, was = stats["transformer"], before["transformer"]
    assert den.replays > was.replays, pipe.accel.report()
    assert (den.misses, den.eager_calls, den.path_misses, den.captures) == (
        was.misses,
        was.eager_calls,
        was.path_misses,
        was.captures,
    ), pipe.accel.report()
    assert den.capture_failures == 0, pipe.accel.report()
    text = stats["text_encoder"]
    assert text.captures == before["text_encoder"].captures == text.entries, pipe.accel.report()


@torch.no_grad()
def test_without_the_recipe_the_omni_pageable_copies_break_a_real_capture(monkeypatch) -> None:
    want = _omni_call(_omni(), PROMPTS[0], 0, (256, 256))
    with monkeypatch.context() as m:
        m.setattr(omni, "install", lambda module: lambda: None)
        m.setattr(omni, "prepare", lambda args, kwargs: (args, kwargs))
        pipe = _omni()
        accelerate_pipeline(pipe, capture_on_miss=True, auto_breaks=False)
        assert torch.equal(_omni_call(pipe, PROMPTS[0], 0, (256, 256)), want)  # eagerly
        assert pipe.accel.stats()["transformer"].capture_failures > 0, pipe.accel.report()
        pipe.accel.restore()
        del pipe
    pipe = _omni()
    accelerate_pipeline(pipe, capture_on_miss=True, auto_breaks=False)
    assert torch.equal(_omni_call(pipe, PROMPTS[0], 0, (256, 256)), want)
    stats = pipe.accel.stats()["transformer"]
    assert stats.capture_failures == 0 and stats.replays > 0 and stats.eager_calls == 0, pipe.accel.report()


@torch.no_grad()
@pytest.mark.parametrize("conditioned", [False, True], ids=["text-to-image", "condition-image"])
def test_tiny_omni_replays_every_step_bit_for_bit(conditioned: bool) -> None:
    pipe, stock = _omni(), _omni()
    extra = dict(image=_image(320, 256, seed=3)) if conditioned else {}
    sizes = [(256, 256), (384, 256)]
    accelerate_pipeline(pipe, auto_breaks=False)
    pipe.accel.warmup(sizes, call_kwargs=extra, progress=False)
    before = pipe.accel.stats()
    for i, (prompt, size) in enumerate([(p, s) for p in PROMPTS for s in reversed(sizes)]):
        got, want = _omni_call(pipe, prompt, i, size, **extra), _omni_call(stock, prompt, i, size, **extra)
        assert torch.equal(got, want), (prompt, size, (got.float() - want.float()).abs().max())
    _after_warmup_only_replays(pipe, before)


@torch.no_grad()
def test_tiny_layered_replays_every_step_bit_for_bit() -> None:
    def build():
        pipe = build_pipeline("qwen-image-layered", "tiny", device=DEV, dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(pipe, prompt: str, seed: int) -> torch.Tensor:
        return pipe(
            image=_image(640, 480, seed, mode="RGBA"),
            prompt=prompt,
            negative_prompt="blurry",
            true_cfg_scale=4.0,
            layers=2,
            num_inference_steps=3,
            output_type="pt",
            generator=torch.Generator(DEV).manual_seed(seed),
        ).images[0]

    pipe, stock = build(), build()
    accelerate_pipeline(pipe, auto_breaks=False)
    pipe.accel.warmup(
        [(640, 480)], prompts=PROMPTS, negative_prompt="blurry", call_kwargs=dict(layers=2), progress=False
    )
    before = pipe.accel.stats()
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(call(pipe, prompt, i), call(stock, prompt, i)), prompt
    _after_warmup_only_replays(pipe, before)


@torch.no_grad()
def test_full_size_omni_1024_decoded_graphs_equal_eager() -> None:
    """The released shapes at 1024x1024, decoded: the same pipeline eagerly, then accelerated (its
    warm-up the documented one, with the prompt), bit for bit; with a condition image too."""
    pipe = _omni("full")
    image = _image(1024, 1024, seed=7)
    prompt = PROMPTS[1]
    eager = [_omni_call(pipe, prompt, 0, (1024, 1024), steps=4, **extra) for extra in ({}, dict(image=image))]
    accelerate_pipeline(pipe, auto_breaks=False)
    for extra, want in zip(({}, dict(image=image)), eager):
        pipe.accel.warmup([(1024, 1024)], prompts=[prompt], call_kwargs=extra, progress=False)
        before = pipe.accel.stats()
        got = _omni_call(pipe, prompt, 0, (1024, 1024), steps=4, **extra)
        assert torch.equal(got, want), (extra.keys(), (got.float() - want.float()).abs().max())
        _after_warmup_only_replays(pipe, before)
