"""A call's images in the file format each request asked for (OpenAI's ``output_format``).

The generation core's files (:func:`pipelines.generation.encode_image`): PNG is the same bytes
``bcg-generate`` writes, with its text chunks (prompt, seed, mode, model, A1111's ``parameters`` ...); JPEG and WebP
carry the same record in their EXIF, and are encoded at ``output_compression`` (OpenAI's 0-100,
100 the default and the best quality).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipelines.generation.formats import encode_image

__all__ = ["FORMATS", "MEDIA_TYPES", "encode"]

FORMATS = ("png", "jpeg", "webp")
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
DEFAULT_COMPRESSION = 100


def encode(image: Any, text: Mapping[str, str], fmt: str = "png", compression: int | None = None) -> bytes:
    """``image`` (PIL) as ``fmt`` bytes; ``compression`` is the JPEG and WebP quality (0-100)."""
    if fmt not in FORMATS:
        raise ValueError(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "png":
        return encode_image(image, text, "png")
    # Pillow's quality runs from 1; OpenAI's output_compression from 0.
    return encode_image(image, text, fmt, max(1, DEFAULT_COMPRESSION if compression is None else compression))
