"""The multipart form of ``POST /v1/images/edits``, checked before anything is queued.

OpenAI's fields: ``image`` (one file; ``image[]`` as its client sends a list), ``prompt``,
``mask`` (a PNG whose fully transparent pixels are redrawn), ``n``, ``size``, ``response_format``,
``model``, ``output_format``, ``output_compression``, and those no setting here matches
(``quality``, ``background``, ``input_fidelity``, ``user`` ...: accepted, ignored and named, as
for generations); this server's extensions ``seed``, ``steps``, ``guidance``, ``negative_prompt``,
``lora`` and ``strength`` (how much of the image is noised again, above 0 to 1: an
image-to-image pipeline's). Form values are text: each is read as its field's type, and a value
that is not one is a 400 naming the field, as a JSON request's would be.

Which pipeline takes the image is the model's business (:mod:`pipelines.generation.image_input`): its own
(an edit model) or the image-to-image or inpainting pipeline diffusers makes from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ServeError
from .schema import ImageRequest, Served, _Body, check_fields

__all__ = ["MAX_EDIT_BYTES", "MAX_INPUT_PIXELS", "parse_edit"]

# A form of one image or two: OpenAI takes files of up to 50 MB.
MAX_EDIT_BYTES = 64 << 20
# An input image's pixels at most: 64 megapixels (8192x8192) is beyond every model's input size,
# and Pillow decodes what it is given whole.
MAX_INPUT_PIXELS = 1 << 26
_INTS = ("n", "output_compression", "partial_images", "seed", "steps")
_FLOATS = ("guidance", "strength")
_BOOLS = ("stream",)


class _EditBody(_Body):
    input_fidelity: str | None = None
    strength: float | None = None


def _typed(name: str, value: str) -> Any:
    """A form value as its field's type; a value that is not one stays text, for the model's check to name."""
    try:
        if name in _INTS:
            return int(value)
        if name in _FLOATS:
            return float(value)
    except ValueError:
        return value
    if name in _BOOLS:
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    return value


def _image(data: bytes, field: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_INPUT_PIXELS:
                raise ServeError(400, f"{field} is {width}x{height}; at most {MAX_INPUT_PIXELS >> 20} megapixels",
                                 param=field, code="image_too_large")  # fmt: skip
            image.load()
            transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
            return image.convert("RGBA" if transparent else "RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise ServeError(400, f"{field} is not an image this server can read (PNG, JPEG or WebP)", param=field,
                         code="invalid_image") from None  # fmt: skip


def parse_edit(fields: Mapping[str, Sequence[str]], files: Mapping[str, Sequence[bytes]],
               served: Served) -> ImageRequest:  # fmt: skip
    """The form's text ``fields`` and ``files`` (each by name, every value given) -> an
    :class:`ImageRequest` with its image, or :class:`ServeError` (400)."""
    images = [*files.get("image", ()), *files.get("image[]", ())]
    if not images:
        given = "image" in fields or "image[]" in fields
        raise ServeError(400, "image is required: a file field of the form" + (" (it came as text)" if given else ""),
                         param="image", code="missing_image")  # fmt: skip
    if len(images) > 1:
        raise ServeError(400, f"image: {len(images)} files given; the models here edit one image at a time",
                         param="image", code="too_many_images")  # fmt: skip
    data: dict[str, Any] = {}
    for name, values in fields.items():
        if name in ("image", "image[]", "mask"):
            continue
        if len(values) > 1:
            raise ServeError(400, f"{name} is given {len(values)} times", param=name, code="invalid_value")
        data[name] = _typed(name, values[0])
    if "prompt" not in data:
        raise ServeError(400, "prompt: Field required", param="prompt", code="invalid_value")
    strength = data.get("strength")
    if isinstance(strength, float) and not (math.isfinite(strength) and 0 < strength <= 1):
        raise ServeError(400, f"strength must be above 0 and at most 1, got {strength:g}", param="strength",
                         code="invalid_value")  # fmt: skip
    masks = files.get("mask", ())
    if len(masks) > 1:
        raise ServeError(400, "mask is given more than once", param="mask", code="invalid_value")
    checked = check_fields(data, served, _EditBody)
    if checked.stream:  # an edit is one pipeline call of its own, which makes no previews
        raise ServeError(400, "stream is served for generations (POST /v1/images/generations) only", param="stream",
                         code="unsupported_stream")  # fmt: skip
    image = _image(images[0], "image")
    mask = _image(masks[0], "mask") if masks else None
    digest = hashlib.sha256(images[0]).hexdigest()[:16]
    note = f"sha256 {digest} ({image.size[0]}x{image.size[1]})" + (", masked" if mask is not None else "")
    ignored = tuple(dict.fromkeys([*checked.ignored, *(n for n in ("input_fidelity",) if data.get(n) is not None)]))
    return dataclasses.replace(checked, image=image, mask=mask, strength=strength, image_note=note, ignored=ignored)
