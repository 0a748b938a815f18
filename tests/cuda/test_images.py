"""PIL images made on the GPU (accel.to_pil_images, and the post-processing hook that uses it) are
diffusers' own, made on the host, bit for bit: the CUDA multiply, round and cast against numpy's,
on every 16-bit value in [0, 1], float32 ties and their neighbours, and random batches; values a
CUDA cast would saturate where numpy's wraps go through diffusers' own code."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from accel import accelerate_pipeline, to_pil_images
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate
from tests.hooks.images.cases import (
    all_values_in_unit_range,
    as_batch,
    diffusers_pil,
    same_images,
    ties_and_neighbours,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("channels", [1, 3])
def test_the_gpus_pixels_are_numpys(dtype: torch.dtype, channels: int) -> None:
    values = [torch.from_numpy(ties_and_neighbours()).to(dtype)]
    if dtype in (torch.bfloat16, torch.float16):
        values.append(all_values_in_unit_range(dtype))
    g = torch.Generator().manual_seed(channels)
    values.append(torch.rand(3 * 64 * 64, generator=g, dtype=torch.float64).to(dtype))
    images = as_batch(torch.cat(values), channels)
    assert same_images(to_pil_images(images.cuda()), diffusers_pil(images))


def test_values_a_cuda_cast_would_saturate_take_diffusers_path() -> None:
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    images[0, 0, 0, :3] = torch.tensor([1.5, -0.25, 1.002])  # numpy wraps 382 and -64 and 256
    images[1, 1, 1, 1] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert same_images(to_pil_images(images.cuda()), diffusers_pil(images))


def test_an_accelerated_pipeline_on_the_gpu_gives_the_stock_pil_images() -> None:
    pipe = build_pipeline("z-image", "tiny").to("cuda")
    pipe.set_progress_bar_config(disable=True)
    stock = generate(pipe, output_type="pil", device="cuda", seed=2, num_images_per_prompt=2)
    accelerate_pipeline(pipe)
    assert "postprocess" in vars(pipe.image_processor)
    assert same_images(generate(pipe, output_type="pil", device="cuda", seed=2, num_images_per_prompt=2), stock)
    pipe.accel.restore()
