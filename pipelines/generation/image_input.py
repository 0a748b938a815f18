"""Models that take an image: which pipeline a call with an input image (and a mask) goes to.

A model takes an image in one of two ways, both read from diffusers, never from a list of ours:

* its own pipeline's call has an ``image`` argument: an edit model (Qwen-Image-Edit, FLUX.1
  Kontext, FLUX.2, Z-Image Omni, Qwen-Image 2.1 ...). Whether it also makes images without one is
  diffusers' word: a class it lists among its text-to-image pipelines (``AutoPipelineForText2Image``)
  does, any other needs the image (:func:`needs_image`);
* diffusers makes an image-to-image (or, with a mask, an inpainting) pipeline from its components
  (``AutoPipelineForImage2Image.from_pipe``): Z-Image, Qwen-Image, FLUX.1 ... The same modules, so
  the same weights, graphs and step caches; only the call differs (``strength``: how much of the
  image is noised again).

A model added to the catalog plugs in by being such a pipeline: nothing here names one.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import InputError, one_line

__all__ = [
    "EDIT",
    "IMG2IMG",
    "INPAINT",
    "ImageInput",
    "fitted",
    "flatten",
    "image_pipeline",
    "load_image",
    "mask_from",
    "needs_image",
    "read_inputs",
    "takes_own_image",
]

logger = logging.getLogger(__name__)

EDIT, IMG2IMG, INPAINT = "edit", "img2img", "inpaint"
IMAGE, MASK, STRENGTH = "image", "mask_image", "strength"


def _params(pipe_class: type) -> Any:
    return inspect.signature(pipe_class.__call__).parameters


def takes_own_image(pipe_class: type) -> bool:
    """Whether the pipeline's own call takes an input image (an edit model)."""
    return IMAGE in _params(pipe_class)


def needs_image(pipe_class: type) -> bool:
    """Whether the pipeline makes images only from an input image: its call takes one and
    diffusers lists it among no text-to-image pipelines (Qwen-Image-Edit, Qwen-Image-Layered)."""
    if not takes_own_image(pipe_class):
        return False
    from diffusers.pipelines.auto_pipeline import AUTO_TEXT2IMAGE_PIPELINES_MAPPING

    return pipe_class not in set(AUTO_TEXT2IMAGE_PIPELINES_MAPPING.values())


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """The pipeline a call with an input image goes to, and what its call takes.

    ``kind``: :data:`EDIT` (the model's own pipeline), :data:`IMG2IMG` or :data:`INPAINT` (made by
    diffusers from the model's components); ``strength``: its call takes ``strength``;
    ``mask``: it takes ``mask_image``.
    """

    pipe: Any
    kind: str
    strength: bool
    mask: bool

    def kwargs(self, image: Any, mask: Any = None, strength: float | None = None) -> dict[str, Any]:
        """The call's image arguments: ``image``, ``mask_image`` where given, ``strength`` where
        given (the pipeline's own default otherwise)."""
        out: dict[str, Any] = {IMAGE: image}
        if mask is not None:
            out[MASK] = mask
        if strength is not None and self.strength:
            out[STRENGTH] = strength
        return out


def image_pipeline(pipe: Any, mask: bool = False) -> ImageInput:
    """The pipeline of ``pipe``'s model that takes an input image (and a mask, with ``mask``);
    InputError, in one line, for a model that takes none (a video model, say)."""
    cls = type(pipe)
    name = cls.__name__
    if takes_own_image(cls) and (not mask or MASK in _params(cls)):
        params = _params(cls)
        return ImageInput(pipe, EDIT, STRENGTH in params, MASK in params)
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    auto, kind = (AutoPipelineForInpainting, INPAINT) if mask else (AutoPipelineForImage2Image, IMG2IMG)
    try:
        sibling = auto.from_pipe(pipe)
    except Exception as e:  # diffusers knows no such pipeline for this one: ValueError, or a missing component
        what = "input image with a mask" if mask else "input image"
        raise InputError(f"{name} takes no {what}, and diffusers makes no {kind} pipeline from it "
                       f"({type(e).__name__}: {one_line(e)[:160]})") from None  # fmt: skip
    sibling.set_progress_bar_config(disable=True)
    params = _params(type(sibling))
    return ImageInput(sibling, kind, STRENGTH in params, MASK in params)


def fitted(kwargs: Mapping[str, Any], size: tuple[int, int]) -> dict[str, Any]:
    """``kwargs``' image and mask resized to ``size`` (width, height), as an image-to-image or
    inpainting pipeline needs them: its latents are its image's, at the call's size."""
    from PIL import Image

    out = dict(kwargs)
    for key, resample in ((IMAGE, Image.Resampling.LANCZOS), (MASK, Image.Resampling.NEAREST)):
        image = out.get(key)
        if image is not None and tuple(image.size) != tuple(size):
            out[key] = image.resize(size, resample)
    return out


def load_image(path: Path, what: str = "--image") -> Any:
    """The image file ``path`` as a PIL image, RGB or (where it has transparency) RGBA, its pixels
    read now; InputError in one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
            return image.convert("RGBA" if transparent else "RGB")
    except FileNotFoundError:
        raise InputError(f"{what} {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} {str(path)!r} is a folder, not an image") from None
    except UnidentifiedImageError:
        raise InputError(f"{what} {str(path)!r} is not an image Pillow can read") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{what} {str(path)!r} cannot be read: {str(e).strip()[:160]}") from None


def mask_from(image: Any) -> Any:
    """A mask as diffusers' inpainting pipelines take it (white: repainted, black: kept) from
    ``image``: one with transparency is OpenAI's mask (its fully transparent pixels are edited),
    any other is read as diffusers' already (grey levels)."""
    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        alpha = image.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 if a == 0 else 0).convert("L")
    return image.convert("L") if image.mode != "L" else image


def flatten(image: Any, pipe: Any = None) -> Any:
    """``image`` as ``pipe`` reads it: RGBA where its VAE reads four channels (Qwen-Image Layered
    splits an RGBA image into RGBA layers), else RGB (a transparent input image's pixels over
    black, as OpenAI's edits read it)."""
    from PIL import Image

    config = getattr(getattr(pipe, "vae", None), "config", None) or {}
    if config.get("input_channels", config.get("in_channels")) == 4:
        return image.convert("RGBA")
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA"):
        background = Image.new("RGB", image.size)
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    return image.convert("RGB")


def read_inputs(image: Path | None, mask: Path | None, strength: float | None, video: bool | None) -> tuple[Any, Any]:
    """``--image`` and ``--mask`` read (PIL; None where not given), before anything is built;
    InputError for a mask or a strength without an image, an input image for a video model (known
    by its name), or a file that is no image."""
    if image is None:
        for flag, value in (("--mask", mask), ("--strength", strength)):
            if value is not None:
                raise InputError(f"{flag} goes with an input image: add --image FILE")
        return None, None
    if video:
        raise InputError("--image: this model makes videos from text; an input image is for image models")
    return load_image(image), (load_image(mask, "--mask") if mask is not None else None)
