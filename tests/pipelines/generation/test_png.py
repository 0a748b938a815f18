"""The fast PNG encoder (:mod:`pipelines.generation.png`): Pillow reads back the same pixels and text as
from the PNG Pillow writes, every chunk but the image data is Pillow's, byte for byte (long values
compressed as Pillow's ``zip=True`` writes them), text holding NUL refused, images it does not
take are Pillow's own save, and the CLI's file and the server's bytes are the same."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from pipelines.cli.files import save_png
from pipelines.generation import png as generation_png
from pipelines.generation.formats import encode_image
from pipelines.generation.png import encode_png

SIZES = [(1, 1), (1, 9), (9, 1), (2, 3), (7, 5), (33, 17), (64, 48), (257, 3)]  # (width, height)
CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}
TEXT = {
    "prompt": "a fox, 日本語 ✓",
    "negative_prompt": "",
    "seed": "7",
    "latin": "café ÿ",
    "Software": "bcg-diffusers 0.0",
    "key with spaces": "a\nmultiline\nvalue",
    "k" * 79: "the longest key PNG allows",
    "long latin": "a red fox in the snow, golden hour; " * 60,
    "long unicode": "狐 " * 2000,
}


def pixels(mode: str, width: int, height: int, kind: str, seed: int = 0) -> np.ndarray:
    """``random``: every byte uniform (no zero image passes by luck); ``natural``: smooth
    gradients with mild noise, as generated images are."""
    rng = np.random.default_rng(seed)
    shape = (height, width, CHANNELS[mode])
    if kind == "random":
        a = rng.integers(0, 256, shape, dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        base = 128 + 60 * np.sin(x[..., None] / 9.0 + np.arange(shape[2])) * np.cos(y[..., None] / 13.0)
        a = np.clip(base + rng.normal(0, 3, shape), 0, 255).astype(np.uint8)
    return a[..., 0] if mode == "L" else a


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The (type, data) of each chunk, each chunk's CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        cid, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(body, zlib.crc32(cid)), cid
        out.append((cid, body))
        pos += 12 + length
    assert pos == len(data) and out[-1] == (b"IEND", b"")
    return out


def pillow_png(image: Image.Image, text: dict[str, str]) -> bytes:
    """The PNG as the CLI wrote it before the fast path."""
    meta = PngInfo()
    for key, value in text.items():
        meta.add_text(key, value, zip=len(value) > generation_png.ZIP_CHARS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=meta, compress_type=zlib.Z_RLE)
    return buffer.getvalue()


def decoded(data: bytes) -> tuple[str, np.ndarray, dict[str, str]]:
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.mode, np.asarray(im), dict(im.text)


@pytest.mark.parametrize("kind", ["random", "natural"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_pillow_reads_the_same_pixels_and_text(mode: str, size: tuple[int, int], kind: str) -> None:
    a = pixels(mode, *size, kind)
    image = Image.fromarray(a)
    ours, theirs = encode_png(image, TEXT), pillow_png(image, TEXT)
    got_mode, got, got_text = decoded(ours)
    assert got_mode == mode and np.array_equal(got, a) and got_text == TEXT
    assert decoded(theirs)[2] == got_text
    # every chunk but the image data is Pillow's, in Pillow's order
    assert [c for c in chunks(ours) if c[0] != b"IDAT"] == [c for c in chunks(theirs) if c[0] != b"IDAT"]


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_the_fast_path_is_taken(mode: str) -> None:
    """Every row behind the one fixed filter, in one zlib stream: not Pillow's save, whose
    adaptive filter chooses per row (and is three times slower)."""
    width, height = 40, 30
    data = encode_png(Image.fromarray(pixels(mode, width, height, "natural")), {"prompt": "x"})
    stream = b"".join(body for cid, body in chunks(data) if cid == b"IDAT")
    rows = np.frombuffer(zlib.decompress(stream), np.uint8).reshape(height, 1 + width * CHANNELS[mode])
    assert (rows[:, 0] == generation_png._FILTER).all()


def test_a_large_image_spans_several_image_data_chunks() -> None:
    a = pixels("RGB", 300, 200, "random")
    data = encode_png(Image.fromarray(a), {})
    assert sum(cid == b"IDAT" for cid, _ in chunks(data)) > 1
    assert np.array_equal(decoded(data)[1], a)


@pytest.mark.parametrize("band", [1, 7, 4096, 1 << 18])
@pytest.mark.parametrize("kind", ["random", "natural"])
def test_bands_deflated_on_threads_make_one_stream_of_the_same_rows(
    monkeypatch: pytest.MonkeyPatch, band: int, kind: str
) -> None:
    """Bands of any size (one byte, odd, not a row's multiple) join into one zlib stream whose
    bytes are the filtered rows a single compressor would have written."""
    monkeypatch.setattr(generation_png, "_BAND_BYTES", band)
    monkeypatch.setattr(generation_png, "_BAND_THREADS", 3)
    width, height = 97, 61 if band > 1 else 5
    a = pixels("RGB", width, height, kind, seed=band)
    data = encode_png(Image.fromarray(a), TEXT)
    stream = b"".join(body for cid, body in chunks(data) if cid == b"IDAT")
    single = zlib.compressobj(
        generation_png._LEVEL, zlib.DEFLATED, 15, generation_png._MEM_LEVEL, generation_png._STRATEGY
    )
    rows = generation_png._filtered(a.reshape(height, -1), 3)
    assert zlib.decompress(stream) == rows.tobytes()  # Adler-32 and the final block checked by zlib
    assert len(rows.tobytes()) < 2 * band or stream != single.compress(rows) + single.flush()  # banded indeed
    mode, got, text = decoded(data)
    assert mode == "RGB" and np.array_equal(got, a) and text == TEXT


def test_text_in_its_order_and_the_chunk_each_value_needs() -> None:
    text = {"b": "ascii", "a": "日本語 ✓", "c": "", "d": "latin-1 é", "e": "😀"}
    data = encode_png(Image.new("RGB", (4, 4), (1, 2, 3)), text)
    kinds = [(cid, body.split(b"\0", 1)[0]) for cid, body in chunks(data) if cid in (b"tEXt", b"iTXt", b"zTXt")]
    assert kinds == [(b"tEXt", b"b"), (b"iTXt", b"a"), (b"tEXt", b"c"), (b"tEXt", b"d"), (b"iTXt", b"e")]
    assert list(decoded(data)[2].items()) == list(text.items())


def test_a_long_value_is_compressed_and_a_200k_prompt_keeps_the_file_small() -> None:
    prompt = "a red fox in the snow at golden hour, " * 5300  # 201,400 characters, as a user sent
    image = Image.new("RGB", (32, 32), (10, 20, 30))
    data = encode_png(image, {"prompt": prompt, "seed": "1"})
    kinds = [cid for cid, _ in chunks(data) if cid in (b"tEXt", b"iTXt", b"zTXt")]
    assert kinds == [b"zTXt", b"tEXt"]  # the long one compressed, the short one not
    assert len(data) < 20_000 and decoded(data)[2] == {"prompt": prompt, "seed": "1"}
    wide = encode_png(image, {"prompt": "狐" * 5000})
    assert [cid for cid, _ in chunks(wide) if cid == b"iTXt"] and decoded(wide)[2]["prompt"] == "狐" * 5000


def test_text_holding_nul_is_refused_not_cut() -> None:
    with pytest.raises(ValueError, match=r"cannot hold NUL \(U\+0000\), and the field 'prompt' has one"):
        encode_png(Image.new("RGB", (2, 2)), {"prompt": "a fox\0 in the snow"})


def test_a_key_pillow_refuses_is_refused() -> None:
    image = Image.new("RGB", (2, 2))
    with pytest.raises(UnicodeEncodeError):
        pillow_png(image, {"ключ": "v"})
    with pytest.raises(UnicodeEncodeError):
        encode_png(image, {"ключ": "v"})


@pytest.mark.parametrize("mode", ["P", "1", "LA", "I;16"])
def test_other_modes_are_pillows_own_save(mode: str) -> None:
    if mode == "I;16":
        wide = np.random.default_rng(3).integers(0, 65536, (7, 13), dtype="<u2")
        image = Image.frombytes("I;16", (13, 7), wide.tobytes())
    else:
        image = Image.fromarray(pixels("RGB", 13, 7, "random")).convert(mode)
    data = encode_png(image, TEXT)
    assert data == pillow_png(image, TEXT)
    got_mode, got, got_text = decoded(data)
    assert got_mode == mode and np.array_equal(got, np.asarray(image)) and got_text == TEXT


def test_a_profile_or_transparency_goes_to_pillow_which_keeps_it() -> None:
    rgb = Image.fromarray(pixels("RGB", 6, 5, "random"))
    rgb.info["icc_profile"] = b"not really a profile"
    grey = Image.fromarray(pixels("L", 6, 5, "random"))
    grey.info["transparency"] = 7
    for image in (rgb, grey):
        data = encode_png(image, TEXT)
        assert data == pillow_png(image, TEXT)
    assert any(cid == b"iCCP" for cid, _ in chunks(encode_png(rgb, {})))
    assert any(cid == b"tRNS" for cid, _ in chunks(encode_png(grey, {})))


@pytest.mark.parametrize(
    ("image", "error"), [(Image.new("CMYK", (3, 3)), OSError), (Image.new("RGB", (0, 4)), ValueError)]
)
def test_what_pillow_cannot_write_fails_as_it_did(image: Image.Image, error: type[Exception]) -> None:
    with pytest.raises(error):
        pillow_png(image, {})
    with pytest.raises(error):
        encode_png(image, {})


@pytest.mark.parametrize("mode", ["RGB", "P"])
def test_png_bytes_are_the_bytes_save_png_writes(tmp_path: Path, mode: str) -> None:
    image = Image.fromarray(pixels("RGB", 37, 21, "natural")).convert(mode)
    written = save_png(image, tmp_path / "a.png", TEXT)
    assert written.read_bytes() == encode_image(image, TEXT, "png") == encode_png(image, TEXT)
