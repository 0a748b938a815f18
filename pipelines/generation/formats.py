"""An image's file in the format asked for (PNG, JPEG or WebP), with the run's record in it, and
the record read back (:func:`read_image_text`).

=========  ===========================================  =============================================
format     how                                          the record
=========  ===========================================  =============================================
``png``    lossless (:func:`~pipelines.generation.png.encode_png`)  text chunks, one a field (``parameters``
                                                        among them, as image browsers read A1111's)
``jpeg``   quality ``quality`` (default 95)             EXIF ImageDescription: the fields as JSON;
                                                        EXIF UserComment: ``parameters``
``webp``   lossless, or lossy at ``quality``            the same EXIF fields as JPEG
=========  ===========================================  =============================================

A JPEG holds at most 64 KiB of EXIF: a record longer than that (a prompt of tens of thousands of
characters) keeps the first :data:`JPEG_TEXT_CHARS` characters of each long field, says how long it
was (``<field>_chars``) and is logged; PNG and WebP keep every character.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .png import encode_png

__all__ = ["FORMATS", "JPEG_TEXT_CHARS", "SUFFIXES", "encode_image", "format_of", "read_image_text"]

logger = logging.getLogger(__name__)

FORMATS = ("png", "jpeg", "webp")
# The files an image goes into, by a file name's suffix, and their formats.
IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
# The suffix each format's files are written with, and every suffix read as each format.
SUFFIXES = {"png": ".png", "jpeg": ".jpg", "webp": ".webp"}
_READ_AS = IMAGE_SUFFIXES
JPEG_QUALITY = 95
EXIF_IMAGE_DESCRIPTION = 0x010E
EXIF_IFD = 0x8769
EXIF_USER_COMMENT = 0x9286
_UNICODE = b"UNICODE\0"  # UserComment's character code for UTF-16 (big-endian, as A1111 writes it)
# A field of a JPEG's record is cut to this many characters where the whole record would not fit
# the 64 KiB of its EXIF segment (JSON escapes a non-ASCII character in up to 12 bytes).
JPEG_TEXT_CHARS = 2000
_JPEG_EXIF_BYTES = 60000


def format_of(path: Path) -> str | None:
    """The image format a file name's suffix asks for (None: no image format written here)."""
    return _READ_AS.get(path.suffix.lower())


def _exif(text: Mapping[str, str]) -> Any:
    from PIL import Image

    exif = Image.Exif()
    exif[EXIF_IMAGE_DESCRIPTION] = json.dumps(dict(text))  # ASCII, EXIF's type for it: any prompt kept
    parameters = text.get("parameters")
    if parameters:
        exif.get_ifd(EXIF_IFD)[EXIF_USER_COMMENT] = _UNICODE + parameters.encode("utf-16-be")
    return exif


def _fitting_jpeg(text: Mapping[str, str]) -> Mapping[str, str]:
    """``text``, its long fields cut where the whole would not fit a JPEG's EXIF segment."""
    exif = _exif(text).tobytes()
    if len(exif) <= _JPEG_EXIF_BYTES:
        return text
    cut = dict(text)
    for key, value in text.items():
        if len(value) > JPEG_TEXT_CHARS:
            cut[key] = value[:JPEG_TEXT_CHARS]
            cut[f"{key}_chars"] = str(len(value))
    logger.warning("a JPEG's record holds at most 64 KiB: its longest fields keep their first %d characters "
                   "(PNG and WebP keep them whole)", JPEG_TEXT_CHARS)  # fmt: skip
    return cut


def encode_image(image: Any, text: Mapping[str, str], fmt: str = "png", quality: int | None = None) -> bytes:
    """``image`` (PIL) as a ``fmt`` file with ``text`` as its record; ``quality``: JPEG's and lossy
    WebP's (1 to 100; WebP without one is lossless, JPEG's default is 95)."""
    if fmt == "png":
        return encode_png(image, text)
    buffer = io.BytesIO()
    if fmt == "jpeg":
        exif = _exif(_fitting_jpeg(text))
        image.convert("RGB").save(buffer, format="JPEG", quality=quality or JPEG_QUALITY, exif=exif)
    elif fmt == "webp":
        options: dict[str, Any] = {"lossless": True} if quality is None else {"quality": quality}
        image.save(buffer, format="WEBP", exif=_exif(text), **options)
    else:
        raise ValueError(f"image format {fmt!r} is not one of {', '.join(FORMATS)}")
    return buffer.getvalue()


def read_image_text(path: str | Path) -> dict[str, str]:
    """The record written into an image file (PNG, JPEG or WebP); ``{}`` where none."""
    from PIL import Image

    with Image.open(Path(path)) as image:
        image.load()
        if image.format == "PNG":
            return dict(getattr(image, "text", {}))
        raw = image.getexif().get(EXIF_IMAGE_DESCRIPTION)
    if not raw:
        return {}
    return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
