"""Pixel batches that test a uint8 conversion where it can go wrong, and diffusers' own result to
hold it to: the CPU tests (tests/hooks/images) and the GPU one (tests/cuda/test_images.py) share them.

The values that matter are those whose product by 255 lands on or next to a rounding boundary:
exact ties m + 0.5 in float32 (k/510 itself is a tie only at 0.5; the others are found by searching
the float32 neighbours of (m + 0.5)/255), their neighbours one ulp away, the boundaries near 0 and
255, and every bfloat16 and float16 value in [0, 1].
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image


def ties_and_neighbours() -> np.ndarray:
    """float32 values x in [0, 1] with x * 255 (in float32) exactly m + 0.5, each with its
    neighbours one ulp either side, plus k/510 for every k, 0, -0.0 and 1."""
    found: list[np.float32] = []
    for m in range(255):
        tie = np.float32(m + 0.5)
        x = np.float32((m + 0.5) / 255)
        for _ in range(8):
            x = np.nextafter(x, np.float32(0))
        for _ in range(17):
            if np.float32(x) * np.float32(255) == tie:
                found += [np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(1))]
            x = np.nextafter(x, np.float32(1))
    k = (np.arange(511, dtype=np.float64) / 510).astype(np.float32)
    values = np.concatenate([np.array(found, np.float32), k, np.array([0.0, -0.0, 1.0], np.float32)])
    assert values.min() >= 0 and values.max() <= 1
    return values


def all_values_in_unit_range(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 16-bit float ``dtype`` in [0, 1] (its bit patterns, read as floats)."""
    bits = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16)  # the non-negative patterns
    values = bits.view(dtype)
    return values[(values >= 0) & (values <= 1)]


def as_batch(values: torch.Tensor, channels: int, width: int = 37) -> torch.Tensor:
    """``values`` laid out as an (N, channels, H, width) batch (the last row padded with ones),
    shuffled so that every channel and position sees some of them."""
    per_image = channels * width * 8
    n = -(-values.numel() // per_image)
    flat = torch.ones(n * per_image, dtype=values.dtype)
    flat[: values.numel()] = values
    flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))]
    return flat.reshape(n, channels, 8, width)


def diffusers_pil(images: torch.Tensor) -> list[Image.Image]:
    """What diffusers' ``postprocess(..., "pil")`` makes of a denormalized batch."""
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))


def same_images(got: list[Image.Image], want: list[Image.Image]) -> bool:
    return len(got) == len(want) and all(
        (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes()) for a, b in zip(got, want)
    )
