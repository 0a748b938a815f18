"""The post-processing hook on the CPU: an accelerated tiny pipeline's ``output_type="pil"`` images
are the stock pipeline's bit for bit (made by the hook, not around it), every other output type is
the original's, anything unfamiliar is left alone, and restore (or dropping the pipeline) takes the
hook out."""

from __future__ import annotations

import gc
import math
import warnings
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from diffusers.image_processor import PixArtImageProcessor, VaeImageProcessor, VaeImageProcessorLDM3D
from diffusers.video_processor import VideoProcessor

from accel import accelerate_pipeline
from accel.graphs import patches
from accel.hooks.images import postprocess as hook_mod
from accel.hooks.images.postprocess import WHY, hook_postprocess, why_not_hooked
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate
from tests.hooks.images.cases import same_images


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes the hook converted on the device (so a test sees the hook ran, not only that the
    pixels agree)."""
    seen: list[tuple[int, ...]] = []
    convert = hook_mod.to_pil_images

    def counted(images: torch.Tensor, checked: Any = None) -> Any:
        seen.append(tuple(images.shape))
        return convert(images, checked)

    monkeypatch.setattr(hook_mod, "to_pil_images", counted)
    return seen


@pytest.mark.parametrize("model", ["z-image", "qwen-image"])
def test_an_accelerated_pipeline_gives_the_stock_pil_images_and_restore_takes_the_hook_out(
    model: str, conversions: list[tuple[int, ...]]
) -> None:
    pipe = build_pipeline(model, "tiny")
    pipe.set_progress_bar_config(disable=True)
    processor = pipe.image_processor
    calls = [dict(seed=3), dict(seed=4, size=(48, 32), num_images_per_prompt=2)]
    stock = [generate(pipe, output_type="pil", **c) for c in calls]
    stock_np = generate(pipe, output_type="np", seed=3)
    assert len(set(stock[1][1].tobytes())) > 16  # real pixels, not a saturated image
    before = patches.active()

    accelerate_pipeline(pipe)
    assert pipe.accel.plan.postprocess_refused is None
    assert "postprocess" in vars(processor)
    assert f"{WHY}: a VaeImageProcessor.postprocess" in patches.active()
    assert "PIL images made on the device" in pipe.accel.report()
    for c, want in zip(calls, stock):
        assert same_images(generate(pipe, output_type="pil", **c), want)
    assert conversions == [(1, 3, 64, 64), (2, 3, 32, 48)]
    # Other output types are the original's, untouched.
    assert np.array_equal(generate(pipe, output_type="np", seed=3), stock_np)
    assert len(conversions) == 2

    pipe.accel.restore()
    assert "postprocess" not in vars(processor)
    assert processor.postprocess.__func__ is VaeImageProcessor.postprocess
    # Nothing of this install is left; patches other tests left behind may be collected meanwhile.
    assert set(patches.active()) <= set(before)
    assert same_images(generate(pipe, output_type="pil", **calls[0]), stock[0])
    assert len(conversions) == 2


def test_a_dropped_pipeline_takes_its_hook_with_it() -> None:
    pipe = build_pipeline("z-image", "tiny")
    processor = pipe.image_processor
    accelerate_pipeline(pipe)
    assert "postprocess" in vars(processor)
    del pipe
    gc.collect()
    assert "postprocess" not in vars(processor)


def _with_own_numpy_to_pil() -> VaeImageProcessor:
    class Own(VaeImageProcessor):
        @staticmethod
        def numpy_to_pil(images: np.ndarray) -> list:
            return VaeImageProcessor.numpy_to_pil(images)

    return Own()


def _replaced_on_the_instance() -> VaeImageProcessor:
    p = VaeImageProcessor()
    p.pt_to_numpy = lambda images: VaeImageProcessor.pt_to_numpy(images)
    return p


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: None, "the pipeline has no image_processor"),
        (lambda: object(), "its image_processor is a object, not a diffusers VaeImageProcessor"),
        (lambda: VideoProcessor(), "video processor"),
        (lambda: VaeImageProcessorLDM3D(), "VaeImageProcessorLDM3D has its own postprocess"),
        (_with_own_numpy_to_pil, "Own has its own numpy_to_pil"),
        (_replaced_on_the_instance, "its pt_to_numpy was replaced on the instance"),
        (lambda: VaeImageProcessor(do_normalize=False), "does not denormalize"),
    ],
    ids=["none", "not-a-processor", "video", "ldm3d", "own-numpy-to-pil", "instance", "no-denormalize"],
)
def test_what_it_cannot_reproduce_is_left_alone(make: Any, why: str) -> None:
    processor = make()
    assert why in (why_not_hooked(processor) or "")
    before = dict(vars(processor)) if hasattr(processor, "__dict__") else None
    with pytest.raises(ValueError, match="post-processing left to diffusers"):
        hook_postprocess(processor)
    assert (dict(vars(processor)) if before is not None else None) == before


def test_another_diffusers_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert why_not_hooked(VaeImageProcessor()) is None
    assert why_not_hooked(PixArtImageProcessor()) is None  # a subclass with diffusers' own postprocess
    for version in ("0.43.0", "0.41.2", "0.42.0.dev0", "not a version"):
        monkeypatch.setattr(diffusers, "__version__", version)
        assert f"diffusers {version} is outside >=0.42,<0.43" in (why_not_hooked(VaeImageProcessor()) or "")


def test_the_wrapper_gives_the_originals_output_for_every_call(conversions: list[tuple[int, ...]]) -> None:
    processor = VaeImageProcessor()
    stock = VaeImageProcessor.postprocess.__get__(processor)
    g = torch.Generator().manual_seed(0)
    decoded = (torch.rand(2, 3, 8, 8, generator=g) * 2.6 - 1.3).to(torch.bfloat16)  # clamped on both ends
    with_nan = decoded.clone()
    with_nan[1, 0, 2, 2] = math.nan
    held = hook_postprocess(processor)
    try:
        assert same_images(processor.postprocess(decoded), stock(decoded))
        assert same_images(processor.postprocess(decoded, "pil", [True, True]), stock(decoded, "pil", [True, True]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's NaN cast, both times
            assert same_images(processor.postprocess(with_nan, output_type="pil"), stock(with_nan, output_type="pil"))
            # Not denormalized: values outside [0, 1] reach the cast (diffusers' numpy path decides).
            unclamped = [False, True]
            assert same_images(processor.postprocess(decoded, "pil", unclamped), stock(decoded, "pil", unclamped))
        assert len(conversions) == 4
        for output_type in ("np", "pt", "latent"):
            got, want = processor.postprocess(decoded, output_type), stock(decoded, output_type)
            assert type(got) is type(want)
            assert torch.equal(got, want) if isinstance(got, torch.Tensor) else np.array_equal(got, want)
        with pytest.raises(ValueError, match="incorrect format"):
            processor.postprocess(decoded.float().numpy())
        assert len(conversions) == 4
        # A second install stacks (a processor two pipelines share), and the wrappers never nest.
        second = hook_postprocess(processor)
        assert same_images(processor.postprocess(decoded), stock(decoded)) and len(conversions) == 5
        held.undo()
        assert "postprocess" in vars(processor)
        second.undo()
        assert "postprocess" not in vars(processor)
    finally:
        held.undo()
