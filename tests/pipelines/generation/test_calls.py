"""One CLI (and server) pipeline call on the CPU: an image pipeline is asked for its decoded
tensor, which is checked and made 8-bit where it is, giving diffusers' own images bit for bit; NaN
pixels are the same one-line error either way; a video pipeline keeps numpy; a layered pipeline's
stacks are each image's layers, whatever stacks it cut them into."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from pipelines.builders import build_pipeline
from pipelines.cli.jobs import plan_jobs
from pipelines.generation import CallSettings, RunError, call_settings
from pipelines.generation.calls import generate_frames
from tests.hooks.images.cases import same_images

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def z_image() -> Any:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_an_image_call_converts_its_tensor_on_the_device_to_diffusers_images(
    z_image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = call_settings(z_image, "z-image", "tiny", steps=2)
    (job,) = plan_jobs(["a fox"], [(64, 48)], 2, 5)
    kwargs = call.kwargs(job, CPU)
    assert kwargs["output_type"] == "pt" and not call.video
    with monkeypatch.context() as m:  # not through the host's numpy
        m.setattr(VaeImageProcessor, "numpy_to_pil", lambda *a: pytest.fail("converted on the host"))
        made = generate_frames(z_image, kwargs, job, "")
    images = made.images
    assert made.videos is None and made.layers is None
    stock = z_image(**{**call.kwargs(job, CPU), "output_type": "pil"}).images
    assert same_images(images, stock) and len(images) == 2
    assert len(set(images[0].tobytes())) > 16  # real pixels, not a saturated image


def test_nan_pixels_are_the_same_one_line_error_on_the_device_as_on_the_host(z_image: Any) -> None:
    call = call_settings(z_image, "z-image", "tiny", steps=2)
    (job,) = plan_jobs(["a fox"], [(64, 64)], 1, 7)
    shape = z_image(**{**call.kwargs(job, CPU), "output_type": "latent"}).images.shape
    errors = []
    for output_type in ("pt", "np"):  # "np": the path every image took before
        kwargs = {**call.kwargs(job, CPU), "output_type": output_type}
        kwargs["latents"] = torch.full(shape, math.nan)
        with pytest.raises(RunError) as e:
            generate_frames(z_image, kwargs, job, " (a hint)")
        errors.append(str(e.value))
    assert (
        errors[0]
        == errors[1]
        == ("the pipeline produced NaN or infinite pixels for 64x64 seed 7 (a hint); nothing was written for this call")
    )


def test_a_video_pipeline_keeps_numpy_frames() -> None:
    images = CallSettings(steps=2, guidance=None, negative_prompt=None, cfg=False, warm_cfg=False, frames=None,
                          guidance_kwarg=None)  # fmt: skip
    (job,) = plan_jobs(["a fox"], [(16, 16)], 1, 0)
    assert images.kwargs(job, CPU)["output_type"] == "pt"
    for video in (
        dataclasses.replace(images, frames=5),
        dataclasses.replace(images, count_kwarg="num_videos_per_prompt"),
    ):
        assert video.video and video.kwargs(job, CPU)["output_type"] == "np"
    assert "output_type" not in dataclasses.replace(images, takes_output_type=False).kwargs(job, CPU)


def test_a_tensor_that_is_not_an_image_batch_is_one_line() -> None:
    @dataclasses.dataclass
    class Output:
        images: torch.Tensor

    def pipe(**kwargs: Any) -> Output:
        return Output(torch.rand(1, 2, 3, 16, 16))

    (job,) = plan_jobs(["a fox"], [(16, 16)], 1, 0)
    with pytest.raises(
        RunError, match=r"returned a torch.float32 tensor of shape \(1, 2, 3, 16, 16\) for output_type='pt'"
    ):
        generate_frames(pipe, {"output_type": "pt"}, job, "")


@dataclasses.dataclass
class _Stacks:
    images: list[Any]


@pytest.mark.parametrize("output_type", ["pt", "np"])
def test_layered_stacks_are_cut_again_per_image_and_checked(output_type: str) -> None:
    """diffusers 0.42.1's Qwen-Image Layered cuts 2 images x 3 layers into stacks of 4 and 2 (it
    counts the input's frame too): the layers go back to their images in order, RGBA kept; a count
    that is no whole number of layers an image, and NaN anywhere, are one line."""
    batch = torch.rand(6, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    as_given = batch if output_type == "pt" else batch.permute(0, 2, 3, 1).numpy()
    (job,) = plan_jobs(["a fox"], [(8, 8)], 2, 0)

    def call(stacks: list[Any]) -> Any:
        return generate_frames(lambda **kwargs: _Stacks(stacks), {"output_type": output_type}, job, "")

    made = call([as_given[:4], as_given[4:]])
    want = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(batch))
    assert [len(stack) for stack in made.layers] == [3, 3] and made.videos is None
    assert same_images([layer for stack in made.layers for layer in stack], want)
    assert made.images == [made.layers[0][0], made.layers[1][0]] and made.images[0].mode == "RGBA"
    with pytest.raises(RunError, match=r"returned 5 layer image\(s\) for 2 image\(s\)"):
        call([as_given[:4], as_given[4:5]])
    poisoned = batch.clone()
    poisoned[5, 0, 0, 0] = math.nan
    nan = poisoned if output_type == "pt" else poisoned.permute(0, 2, 3, 1).numpy()
    with pytest.raises(RunError, match="NaN or infinite pixels"):
        call([nan[:4], nan[4:]])


def test_a_call_reads_bcg_only_where_a_denoiser_replayed() -> None:
    """The record's mode follows the denoisers: a text encoder's replay beside an eager denoiser
    is an eager call, a denoiser's replay a ``bcg`` one, and an accel that cannot tell keeps what
    was asked."""
    from types import SimpleNamespace

    from pipelines.generation.calls import graph_replays, mode_ran

    counts = {"transformer": 0, "text_encoder": 0}

    class Accel:
        def __init__(self) -> None:
            self.recipes = {"transformer": object()}

        def stats(self, memory: bool = True) -> dict[str, Any]:
            return {name: SimpleNamespace(replays=n) for name, n in counts.items()}

    pipe = SimpleNamespace(accel=Accel())
    before = graph_replays(pipe)
    counts["text_encoder"] += 2
    assert mode_ran(pipe, "bcg", before) == "eager"
    before = graph_replays(pipe)
    counts["transformer"] += 1
    assert mode_ran(pipe, "bcg", before) == "bcg"
    assert mode_ran(pipe, "eager", before) == "eager"
    assert mode_ran(SimpleNamespace(), "bcg", graph_replays(SimpleNamespace())) == "bcg"
