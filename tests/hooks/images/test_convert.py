"""A decoded batch to PIL images on its own device (here the CPU's torch): diffusers'
``numpy_to_pil(pt_to_numpy(x))`` bit for bit, for every dtype, channel count and the values that
round on a boundary; NaN and out-of-range values through diffusers' own code; the checks in one
reduction."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from accel import check_pixels, to_pil_images
from accel.hooks.images import PixelCheck, convert
from tests.hooks.images.cases import (
    all_values_in_unit_range,
    as_batch,
    diffusers_pil,
    same_images,
    ties_and_neighbours,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture
def device_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values in [0, 1] must take the device path: a fallback to diffusers' numpy would pass vacuously."""

    def refuse(images: torch.Tensor) -> list:
        raise AssertionError("values in [0, 1] went through diffusers' numpy path")

    monkeypatch.setattr(convert, "_diffusers_numpy_path", refuse)


@pytest.mark.usefixtures("device_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("shape", [(1, 16, 16), (3, 17, 23), (2, 1, 9), (2, 9, 1), (1, 1, 1)])
def test_random_batches_give_diffusers_images(dtype: torch.dtype, channels: int, shape: tuple[int, int, int]) -> None:
    n, h, w = shape
    g = torch.Generator().manual_seed(channels * 1000 + h * 10 + w)
    images = torch.rand(n, channels, h, w, generator=g, dtype=torch.float64).to(dtype)
    # Values that round next to 0 and 255, and exact ones, somewhere in every batch.
    edge = torch.tensor([0.0, 1.0, 0.49 / 255, 0.51 / 255, 254.49 / 255, 254.51 / 255, 0.5], dtype=torch.float64)
    flat = images.view(-1)
    flat[: min(edge.numel(), flat.numel())] = edge[: flat.numel()].to(dtype)
    if channels == 1 and h == w == 1:
        # diffusers' squeeze leaves a 0-dim array, which PIL refuses: the same error here.
        with pytest.raises(IndexError):
            diffusers_pil(images)
        with pytest.raises(IndexError):
            to_pil_images(images)
        return
    given = images.clone()
    got = to_pil_images(images)
    assert torch.equal(images, given)  # the caller's batch is left as it was
    want = diffusers_pil(images)
    assert same_images(got, want)
    assert {im.mode for im in got} == {"L" if channels == 1 else "RGB" if channels == 3 else "RGBA"}


@pytest.mark.usefixtures("device_path_only")
@pytest.mark.parametrize("channels", [1, 3])
def test_float32_ties_and_their_neighbours_round_half_to_even_as_numpy_does(channels: int) -> None:
    values = torch.from_numpy(ties_and_neighbours())
    products = values.numpy() * np.float32(255)
    assert (products % 1 == 0.5).sum() > 255  # ties for (nearly) every m, 127.5 and 0.5 among them
    images = as_batch(values, channels)
    assert same_images(to_pil_images(images), diffusers_pil(images))
    # Half to even, as numpy's rint: the tie 127.5 (x = 0.5) goes to 128, not 127.
    half = to_pil_images(torch.full((1, channels, 1, 2), 0.5))
    assert set(half[0].tobytes()) == {128}


@pytest.mark.usefixtures("device_path_only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels", [1, 3])
def test_every_16_bit_value_in_the_unit_range(dtype: torch.dtype, channels: int) -> None:
    images = as_batch(all_values_in_unit_range(dtype), channels)
    assert same_images(to_pil_images(images), diffusers_pil(images))


def test_nan_and_out_of_range_values_take_diffusers_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where nothing clamped (do_normalize off, or do_denormalize False): numpy's cast wraps 256 to
    # 0 and -1 to 255 where CUDA's saturates; NaN's cast is undefined. diffusers' own code decides.
    taken = []
    numpy_path = convert._diffusers_numpy_path
    monkeypatch.setattr(convert, "_diffusers_numpy_path", lambda x: taken.append(x.shape) or numpy_path(x))
    images = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(1))
    images[0, 0, 0, :4] = torch.tensor([1.5, -0.25, 1.002, -1e-6])
    images[1, 2, 3, 4] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "invalid value encountered in cast", both times
        got, want = to_pil_images(images), diffusers_pil(images)
    assert same_images(got, want)
    assert check_pixels(images) == PixelCheck(finite=False, in_unit_range=False)
    assert same_images(to_pil_images(images[:1]), diffusers_pil(images[:1]))  # finite, out of range
    assert taken == [images.shape, images[:1].shape]


def test_a_checked_batch_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    images = torch.rand(1, 3, 4, 4)
    found = check_pixels(images)
    monkeypatch.setattr(convert, "check_pixels", lambda images: pytest.fail("checked twice"))
    assert same_images(to_pil_images(images, found), diffusers_pil(images))


def test_an_empty_batch_and_wrong_shapes() -> None:
    empty = torch.rand(0, 3, 4, 4)
    assert to_pil_images(empty) == diffusers_pil(empty) == []
    assert check_pixels(empty) == PixelCheck(True, True)
    # pt_to_numpy permutes four dimensions: a (C, H, W) tensor is refused (diffusers raises too).
    with pytest.raises(ValueError, match=r"floating \(N, C, H, W\) tensor, got torch.float32 of shape \(3, 4, 4\)"):
        to_pil_images(torch.rand(3, 4, 4))
    with pytest.raises(RuntimeError):
        diffusers_pil(torch.rand(3, 4, 4))
    with pytest.raises(ValueError, match=r"torch\.uint8"):
        to_pil_images(torch.zeros(1, 3, 4, 4, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_pixels_in_one_reduction(dtype: torch.dtype) -> None:
    ok = torch.rand(2, 3, 4, 4).to(dtype)
    assert check_pixels(ok) == PixelCheck(True, True)
    for bad, expected in [
        (math.nan, PixelCheck(False, False)),
        (math.inf, PixelCheck(False, False)),
        (-math.inf, PixelCheck(False, False)),
        (1.5, PixelCheck(True, False)),
        (-0.5, PixelCheck(True, False)),
        (-0.0, PixelCheck(True, True)),
    ]:
        images = ok.clone()
        images[1, 2, 3, 3] = bad
        assert check_pixels(images) == expected, bad
