"""A pipeline's ``image_processor.postprocess(..., output_type="pil")`` with the pixels made on the device.

:func:`hook_postprocess` puts a wrapper in one diffusers ``VaeImageProcessor``'s instance
dictionary (a reversible patch, :mod:`accel.graphs.patches`, that the caller undoes; the class is
untouched). For ``output_type="pil"`` on a floating (N, C, H, W) tensor the wrapper calls
diffusers' own ``postprocess`` with ``output_type="pt"``, so everything up to the float tensor
(the checks, the denormalize and its clamp, on the device) is diffusers' code, and hands the
tensor to :func:`~accel.hooks.images.convert.to_pil_images`, which gives what the rest of that
``postprocess`` (``pt_to_numpy``, then ``numpy_to_pil``) gives, bit for bit. Every other call
(``"np"``, ``"pt"``, ``"latent"``, anything else) is the original's, untouched.

It must never change an image, so :func:`why_not_hooked` leaves alone, saying why, every processor
whose post-processing is not the code :mod:`~accel.hooks.images.convert` reproduces:

* diffusers outside :data:`TESTED_DIFFUSERS`, the range whose ``numpy_to_pil`` was read;
* a class or an instance with its own ``postprocess``, ``pt_to_numpy`` or ``numpy_to_pil``
  (diffusers' ``VaeImageProcessorLDM3D`` makes depth maps in its own);
* a video processor: its frames go through ``postprocess`` once per video, and are the video
  pipeline's job, not the image processor's;
* a config that does not denormalize (``do_normalize`` off): nothing clamps its values to [0, 1],
  so the device conversion would rarely apply (it would still be exact: out-of-range values take
  diffusers' numpy path).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

from ...graphs.patches import MISSING, Patch, patch, unpatched
from .convert import to_pil_images

__all__ = ["TESTED_DIFFUSERS", "WHY", "hook_postprocess", "why_not_hooked"]

# The diffusers whose VaeImageProcessor.postprocess, pt_to_numpy and numpy_to_pil were read (and
# are tested) against :mod:`accel.hooks.images.convert`; the range the recipes are tested with.
TESTED_DIFFUSERS = ">=0.42,<0.43"
WHY = "PIL images made on the device (output_type='pil')"
_REPRODUCED = ("postprocess", "pt_to_numpy", "numpy_to_pil")


def why_not_hooked(processor: Any) -> str | None:
    """Why ``processor`` (a pipeline's ``image_processor``, or None) keeps diffusers' own
    post-processing (see the module's docstring), or None where :func:`hook_postprocess` may wrap it."""
    if processor is None:
        return "the pipeline has no image_processor"
    import diffusers
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.video_processor import VideoProcessor

    if not isinstance(processor, VaeImageProcessor):
        return f"its image_processor is a {type(processor).__name__}, not a diffusers VaeImageProcessor"
    if isinstance(processor, VideoProcessor):
        return f"its image_processor is a video processor ({type(processor).__name__})"
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        tested = Version(diffusers.__version__) in SpecifierSet(TESTED_DIFFUSERS)
    except InvalidVersion:
        tested = False
    if not tested:
        return f"diffusers {diffusers.__version__} is outside {TESTED_DIFFUSERS}, whose post-processing was read"
    cls = type(processor)
    for name in _REPRODUCED:
        if inspect.getattr_static(cls, name) is not inspect.getattr_static(VaeImageProcessor, name):
            return f"{cls.__name__} has its own {name}"
        # Ours (another pipeline's install) may be there: patches of one place stack.
        if name in vars(processor) and unpatched(processor, name, where="dict") is not MISSING:
            return f"its {name} was replaced on the instance"
    if processor.config.get("do_normalize") is not True:
        return "its config does not denormalize (do_normalize is off), so nothing clamps its pixels to [0, 1]"
    return None


def hook_postprocess(processor: Any) -> Patch:
    """Wrap ``processor.postprocess`` (see the module's docstring); undo the returned patch to take
    the wrapper out. ValueError, changing nothing, where :func:`why_not_hooked` says why not."""
    why = why_not_hooked(processor)
    if why is not None:
        raise ValueError(f"post-processing left to diffusers: {why}")
    return patch(processor, "postprocess", types.MethodType(_postprocess, processor), why=WHY, where="dict")


def _postprocess(self: Any, image: Any, output_type: str = "pil", do_denormalize: list[bool] | None = None) -> Any:
    """VaeImageProcessor.postprocess's signature, bound to one processor (a method, as the
    attribute it shadows is)."""
    from diffusers.image_processor import VaeImageProcessor

    # The class's own function, checked by why_not_hooked to be the one whose code was read; never
    # the current attribute, so a second install's wrapper never wraps the first one's.
    stock = VaeImageProcessor.postprocess
    # Anything but a plain float batch (a wrong input's error, a tensor that needs grad, whose
    # .numpy() diffusers refuses) is the original's, as are the other output types.
    if (
        output_type != "pil"
        or not isinstance(image, torch.Tensor)
        or image.ndim != 4
        or not image.is_floating_point()
        or image.requires_grad
    ):
        return stock(self, image, output_type, do_denormalize)
    decoded = stock(self, image, "pt", do_denormalize)  # diffusers' denormalize, on the device
    if not isinstance(decoded, torch.Tensor) or decoded.ndim != 4 or not decoded.is_floating_point():
        return self.numpy_to_pil(self.pt_to_numpy(decoded))  # the rest of diffusers' own
    return to_pil_images(decoded)
