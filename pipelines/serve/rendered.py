"""A pipeline call's images: as the call made them (PIL, with their PNG text), and as the answer
carries them (each file encoded in its request's format, base64).

The device worker hands on :class:`RenderedImage` and goes on to its next call; the service's
encoding threads make each into its files (:meth:`RenderedImage.files`: a layered model's image
is one file per layer), the :class:`EncodedImage` the routes answer with.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

from pipelines.generation.prompts import TokenCount

from .encode import encode

__all__ = ["EncodedImage", "RenderedImage"]


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """One image as the response carries it: its file in the format asked for, base64-encoded
    (ASCII bytes: the route writes them into the answer as they are), the seed it was made with,
    its prompt's tokens as the text encoder read them (None: not counted), which layer of its
    image it is (a layered model's; None: the image itself), and its size as made ("WxH"; a
    pipeline that picks its own size from an input image may differ from the request's)."""

    b64: bytes
    seed: int
    tokens: TokenCount | None = None
    layer: int | None = None
    size: str | None = None

    @property
    def b64_json(self) -> str:
        """The base64 as text (OpenAI's ``b64_json``)."""
        return self.b64.decode("ascii")


@dataclasses.dataclass(frozen=True)
class RenderedImage:
    """One image as its call made it (PIL), with its PNG text, seed, tokens and the file format
    its request asked for. Encoding takes tens of milliseconds an image at 512x512 (PNG, zlib), so
    the device worker hands these on and the service's encoding threads encode them
    (:meth:`encode`): the device starts the next call meanwhile. ``layers``: a layered model's
    image is its layers (RGBA), each answered as a file of its own (:meth:`files`)."""

    image: Any
    text: dict[str, str]
    seed: int
    tokens: TokenCount | None
    output_format: str = "png"
    output_compression: int | None = None
    layers: Sequence[Any] | None = None

    def encode(self) -> EncodedImage:
        data = encode(self.image, self.text, self.output_format, self.output_compression)
        return EncodedImage(base64.b64encode(data), self.seed, self.tokens, size=_size(self.image))

    def files(self) -> list[EncodedImage]:
        """The answer's files of this image: the image, or each of its layers in order, each
        recording which layer it is."""
        if self.layers is None:
            return [self.encode()]
        out = []
        for k, layer in enumerate(self.layers):
            text = {**self.text, "layer": str(k), "layers": str(len(self.layers))}
            data = encode(layer, text, self.output_format, self.output_compression)
            out.append(EncodedImage(base64.b64encode(data), self.seed, self.tokens, k, _size(layer)))
        return out


def _size(image: Any) -> str | None:
    """A PIL image's "WxH" (None for anything without a PIL size)."""
    size = getattr(image, "size", None)
    return f"{size[0]}x{size[1]}" if isinstance(size, tuple) and len(size) == 2 else None
