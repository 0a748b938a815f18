"""PNG bytes of an 8-bit image, fast: :func:`encode_png`.

Pillow decodes them to the same pixels and the same text as the PNG Pillow writes with
``pnginfo`` (``add_text`` for each key, ``zip=True`` for a value over :data:`ZIP_CHARS`
characters) and ``compress_type=zlib.Z_RLE``, and every chunk but the image data is the same bytes
in the same order. A long value (a prompt of thousands of words) is compressed (zTXt, or iTXt
with its compression flag): a 200,000-character prompt no longer makes a 10 KB image 210 KB. A
value holding NUL is refused (ValueError): PNG text ends at a NUL, so the record would be cut
there. Modes ``L``, ``RGB`` and ``RGBA`` without an ICC profile or transparency in ``image.info``
take the fast path; any other image is Pillow's own save with those options.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ZIP_CHARS", "encode_png"]

# Text values longer than this are compressed (as Pillow's add_text(..., zip=True) writes them).
ZIP_CHARS = 1024

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# mode: (samples a pixel, PNG colour type); bit depth 8 for all
_MODES = {"L": (1, 0), "RGB": (3, 2), "RGBA": (4, 6)}
# Pillow adapts the filter row by row (most of its time); one fixed filter for every row, vectorized,
# is a fraction of that. Average measured the smallest of None, Sub, Up and Average on smooth and on
# photographic images, for a little more time than Sub (docs/benchmarks.md).
_FILTER = 3
# Run-length matching: less than half the time of zlib's default strategy at level 1 on these
# filtered rows, and smaller; Huffman-only is a tenth faster but 60x larger on flat images.
_LEVEL, _MEM_LEVEL, _STRATEGY = 6, 9, zlib.Z_RLE
# Pillow's save, for the images the fast path does not take: the same strategy, for the file size
# of Pillow's default on generated images in half its time (lossless either way).
_PNG_OPTIONS: dict[str, Any] = {"compress_type": _STRATEGY}
# what Pillow writes into one IDAT (ImageFile.MAXBLOCK); any split is valid PNG
_IDAT_SIZE = 65536
# Deflate is one thread's work; bands of the filtered rows are deflated on threads of their own
# (zlib lets go of the GIL) and joined into one zlib stream, as pigz does. Run-length matches
# reach one byte back, so a band boundary costs a few bytes. A served image's encoding is on its
# request's path: at 512x512 (786 KB) this halves it on two cores. Small images stay one call.
_BAND_BYTES = 1 << 18
_BAND_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _chunk(cid: bytes, data: bytes | memoryview) -> bytes:
    return b"".join((struct.pack(">I", len(data)), cid, data, struct.pack(">I", zlib.crc32(data, zlib.crc32(cid)))))


def _check_text(key: str, value: str) -> None:
    if "\0" in key or "\0" in value:
        raise ValueError(f"PNG text cannot hold NUL (U+0000), and the field {key!r} has one")


def _text_chunk(key: str, value: str) -> bytes:
    # as PngInfo.add_text(key, value, zip=len(value) > ZIP_CHARS): tEXt (zTXt) where the value is
    # latin-1, else iTXt, compressed or not, with no language or translated key
    zipped = len(value) > ZIP_CHARS
    name = key.encode("latin-1")
    try:
        raw = value.encode("latin-1")
        data = (b"zTXt", name + b"\0\0" + zlib.compress(raw)) if zipped else (b"tEXt", name + b"\0" + raw)
    except UnicodeEncodeError:
        text = value.encode("utf-8")
        data = b"iTXt", name + (b"\0\1\0\0\0" + zlib.compress(text) if zipped else b"\0\0\0\0\0" + text)
    return _chunk(*data)


def _filtered(pixels: np.ndarray, samples: int) -> np.ndarray:
    """Each row of ``pixels`` (height, width * samples) behind its filter byte, Average filtered:
    each byte less the floor of the mean of the bytes left (a pixel before) and up, modulo 256."""
    import numpy as np

    height, row = pixels.shape
    out = np.empty((height, 1 + row), np.uint8)
    out[:, 0] = _FILTER
    left = np.zeros_like(pixels)
    left[:, samples:] = pixels[:, :-samples]
    up = np.zeros_like(pixels)
    up[1:] = pixels[:-1]
    mean = np.bitwise_xor(left, up)  # floor((a + b) / 2) in uint8: (a & b) + ((a ^ b) >> 1)
    np.right_shift(mean, 1, out=mean)
    np.bitwise_and(left, up, out=left)
    mean += left
    np.subtract(pixels, mean, out=out[:, 1:])
    return out


def _band(data: memoryview, last: bool) -> bytes:
    # raw deflate (no header): a band flushed to a byte boundary without its final bit, so the
    # next band's blocks follow it in one stream; the last band ends the stream
    compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, -15, _MEM_LEVEL, _STRATEGY)
    return compressor.compress(data) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def _bands_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_BAND_THREADS, thread_name_prefix="png")
        return _pool


def _deflate(data: memoryview) -> bytes:
    """``data`` (bytes, flat) as one zlib stream (header, deflate blocks, Adler-32)."""
    if _BAND_THREADS == 1 or len(data) < 2 * _BAND_BYTES:
        compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, 15, _MEM_LEVEL, _STRATEGY)
        return compressor.compress(data) + compressor.flush()
    bands = [data[i : i + _BAND_BYTES] for i in range(0, len(data), _BAND_BYTES)]
    pool = _bands_pool()
    futures = [pool.submit(_band, band, i == len(bands) - 1) for i, band in enumerate(bands)]
    checksum = struct.pack(">I", zlib.adler32(data))  # meanwhile, on this thread
    return b"".join((b"\x78\x9c", *(f.result() for f in futures), checksum))


def _pillow_png(image: Any, text: Mapping[str, str]) -> bytes:
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in text.items():
        meta.add_text(key, value, zip=len(value) > ZIP_CHARS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=meta, **_PNG_OPTIONS)
    return buffer.getvalue()


def encode_png(image: Any, text: Mapping[str, str]) -> bytes:
    """``image`` (PIL) as PNG bytes with ``text`` as its text chunks, in its order; ValueError for
    text holding NUL."""
    for key, value in text.items():
        _check_text(key, value)
    mode = _MODES.get(image.mode)
    width, height = image.size
    info = image.info
    # Pillow writes an iCCP or a tRNS chunk for these, and refuses an empty image: its own save says
    if mode is None or not width or not height or info.get("icc_profile") or info.get("transparency") is not None:
        return _pillow_png(image, text)
    import numpy as np  # here: --help and argument errors need no numpy (60 ms to import)

    samples, colour_type = mode
    pixels = np.asarray(image, dtype=np.uint8).reshape(height, width * samples)
    stream = memoryview(_deflate(memoryview(_filtered(pixels, samples).reshape(-1))))
    parts = [_SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0))]
    parts += [_text_chunk(key, value) for key, value in text.items()]
    parts += [_chunk(b"IDAT", stream[i : i + _IDAT_SIZE]) for i in range(0, len(stream), _IDAT_SIZE)]
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)
