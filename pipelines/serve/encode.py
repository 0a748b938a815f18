"""A call's images in the file format each request asked for (OpenAI's ``output_format``).

PNG is the CLI's file: the same bytes ``bcg-generate`` writes, with its text chunks (prompt,
seed, mode, model ...). JPEG and WebP are encoded at ``output_compression`` (OpenAI's 0-100,
100 the default and the best quality). JPEG carries the same record as its comment; WebP carries
none (Pillow writes no text into it): a client that needs the record asks for PNG.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from pipelines.cli.images import png_bytes

__all__ = ["FORMATS", "MEDIA_TYPES", "encode", "encode_all"]

FORMATS = ("png", "jpeg", "webp")
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
DEFAULT_COMPRESSION = 100


def _record(text: Mapping[str, str]) -> bytes:
    return "\n".join(f"{k}: {v}" for k, v in text.items()).encode("utf-8", "replace")


def encode(image: Any, text: Mapping[str, str], fmt: str = "png", compression: int | None = None) -> bytes:
    """``image`` (PIL) as ``fmt`` bytes; ``compression`` is the JPEG and WebP quality (0-100)."""
    if fmt == "png":
        return png_bytes(image, text)
    quality = DEFAULT_COMPRESSION if compression is None else compression
    buffer = io.BytesIO()
    if fmt == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=quality, comment=_record(text))
    elif fmt == "webp":
        image.save(buffer, format="WEBP", quality=quality)
    else:
        raise ValueError(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
    return buffer.getvalue()


def encode_all(
    images: Sequence[Any], texts: Sequence[Mapping[str, str]], fmt: str, compression: int | None
) -> list[bytes]:
    """:func:`encode` for each image with its text."""
    return [encode(image, text, fmt, compression) for image, text in zip(images, texts)]
