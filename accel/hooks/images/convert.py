"""A decoded image batch to PIL images, with the float work on the tensor's own device.

diffusers' ``VaeImageProcessor.postprocess(x, output_type="pil")`` ends in
``numpy_to_pil(pt_to_numpy(x))``: the float batch (N, C, H, W) is copied to the host, permuted and
widened to float32 there, then multiplied by 255, rounded and cast to uint8 by numpy, all while
the device idles (a few percent of a call: docs/benchmarks.md, "Measurements behind the code"). :func:`to_pil_images` does that arithmetic where the tensor is and copies only
the uint8 pixels to the host, in one copy of a quarter of float32's bytes; PIL then wraps each
image as diffusers does.

Contract:

* For finite values in [0, 1] (what diffusers' ``denormalize`` leaves: it clamps), the images are
  diffusers 0.42's ``numpy_to_pil(pt_to_numpy(x))`` bit for bit, on any device and from any
  floating dtype: same modes, sizes and bytes (one channel gives mode "L", through the same
  ``squeeze`` as diffusers').
* Other values (NaN; values outside [0, 1] where nothing clamped) go through diffusers' own numpy
  code instead, so they too give its pixels: casting them to uint8 is undefined in C, and numpy's
  cast wraps them where a CUDA cast saturates. Telling costs one reduction and one sync
  (:func:`check_pixels`), queued after the conversion's kernels so the device is never waited on
  twice; a caller that checked already passes its :class:`PixelCheck`.
* Only (N, C, H, W) tensors: ``pt_to_numpy`` permutes four dimensions, so numpy_to_pil's own
  branch for a three-dimensional (H, W, C) array is never reached from a tensor. Anything else is
  a ValueError.

Knows nothing of pipelines; :mod:`accel.hooks.images.postprocess` puts it behind a pipeline's
``output_type="pil"``, and the command line calls it on ``output_type="pt"`` results.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

__all__ = ["PixelCheck", "check_pixels", "to_pil_images"]


class PixelCheck(NamedTuple):
    """What :func:`check_pixels` found in a batch.

    Attributes:
        finite: no NaN and no infinity anywhere.
        in_unit_range: every value in [0, 1] (so finite too): the device conversion is exact.
    """

    finite: bool
    in_unit_range: bool


def check_pixels(images: torch.Tensor) -> PixelCheck:
    """Whether ``images`` (any shape, any floating dtype, on any device) are finite and in [0, 1],
    from one reduction on their device and one sync."""
    if images.numel() == 0:
        return PixelCheck(True, True)
    # min and max propagate NaN, and an infinity is an extreme: the two say everything.
    low, high = torch.stack(torch.aminmax(images.detach())).tolist()
    finite = math.isfinite(low) and math.isfinite(high)
    return PixelCheck(finite, finite and low >= 0.0 and high <= 1.0)


def to_pil_images(images: torch.Tensor, checked: PixelCheck | None = None) -> list[Image.Image]:
    """``images`` (N, C, H, W), floating, on any device, as diffusers' ``numpy_to_pil(pt_to_numpy(images))``
    makes them, bit for bit (see the module's contract).

    ``checked``: what :func:`check_pixels` said of these very images, where the caller asked
    already (one sync fewer); None checks here.
    """
    if images.ndim != 4 or not images.is_floating_point():
        raise ValueError(
            f"to_pil_images takes a floating (N, C, H, W) tensor, got {images.dtype} of shape {tuple(images.shape)}"
        )
    pixels = _to_uint8_nhwc(images)  # queued on the device; the check's sync waits for it too
    found = checked if checked is not None else check_pixels(images)
    if not found.in_unit_range:
        return _diffusers_numpy_path(images)
    return _from_uint8(pixels.cpu().numpy())


def _to_uint8_nhwc(images: torch.Tensor) -> torch.Tensor:
    """numpy_to_pil's arithmetic on pt_to_numpy's float32 values, on ``images``' device.

    Each step is the one numpy does, in the same dtype, so each gives the same bits (for values in
    [0, 1]; :func:`to_pil_images` sends others to numpy):

    * ``.float()`` is pt_to_numpy's own widening: bfloat16 and float16 to float32 is exact; float64
      to float32 rounds to nearest even on every device, as the host does.
    * ``* 255``: a float32 tensor times a Python int stays float32 in torch (a Python number never
      promotes a tensor of its own kind, and CUDA computes a float32 product in float32), as a
      float32 array times a Python int does in numpy 2 (NEP 50: a Python int is a weak scalar; 1.x
      kept float32 too). One IEEE-754 multiply, correctly rounded, on the CPU and on CUDA alike;
      255 is exact. It is a kernel of its own, so nothing can contract it into a fused
      multiply-add (eager mode fuses nothing, and no addition follows it).
    * ``.round()``: half to even in both (numpy's ``rint``; torch's ``nearbyint`` on CUDA and the
      round-to-nearest vector instruction on the CPU), so a tie like 127.5 goes to 128 and 0.5 to 0
      in both.
    * ``.to(torch.uint8)``: the rounded values are whole numbers in [0, 255]: exact.
    * The permute to (N, H, W, C), made contiguous here, moves uint8 bytes, not values: a quarter
      of float32's bytes, and the host copy that follows is then one contiguous block.

    One float32 buffer at a time (the multiply and round in place where ``.float()`` made a copy;
    the same kernels as out of place): a batch of eight at 1024x1024 is 100 MB of them.
    """
    widened = images.float()
    scaled = widened.mul_(255) if widened is not images else widened * 255  # never the caller's tensor
    return scaled.round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _from_uint8(array: np.ndarray) -> list[Image.Image]:
    """numpy_to_pil's PIL step, as diffusers 0.42 writes it, on (N, H, W, C) uint8 pixels."""
    if array.shape[-1] == 1:
        # diffusers' grayscale branch: squeeze (every axis of size one, as it does) and mode "L".
        return [Image.fromarray(image.squeeze(), mode="L") for image in array]
    return [Image.fromarray(image) for image in array]


def _diffusers_numpy_path(images: torch.Tensor) -> list[Image.Image]:
    # Values whose uint8 cast differs between numpy and a device: diffusers' own code gives its
    # own pixels (and its own RuntimeWarning for a NaN cast), whatever they are.
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))
