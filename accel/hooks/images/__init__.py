"""Images out of a pipeline: a decoded batch to PIL images on its own device, the hook that
makes a pipeline's ``output_type="pil"`` do that, and which sizes the VAE decoder decodes with
graphs (those where they pay, timed at warm-up).

Owns :func:`~accel.hooks.images.convert.to_pil_images` (diffusers' ``numpy_to_pil(pt_to_numpy(x))``
bit for bit, with the float work on the tensor's device and one uint8 copy to the host) and
:func:`~accel.hooks.images.convert.check_pixels` (finite and in [0, 1], one sync), and the
reversible wrapper an installation puts on a pipeline's ``image_processor.postprocess``
(:mod:`accel.hooks.images.postprocess`), which leaves any processor it cannot reproduce alone;
and the decoder's trial at warm-up (:mod:`accel.hooks.images.decoder_trial`, measuring each size;
:mod:`accel.hooks.images.decoder_verdict`, the rule: its graphs kept only at the sizes where they
pay, faster than the eager decode beyond noise or lowering the peak memory the process reaches).

May import: :mod:`accel.graphs` (its reversible patches, the runner and pool the trial times) and
diffusers; nothing of this layer outside the package.
"""

from .convert import PixelCheck, check_pixels, to_pil_images
from .postprocess import TESTED_DIFFUSERS, hook_postprocess, why_not_hooked

__all__ = ["TESTED_DIFFUSERS", "PixelCheck", "check_pixels", "hook_postprocess", "to_pil_images", "why_not_hooked"]
