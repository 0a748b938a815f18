"""The request body of ``POST /v1/images/generations``, checked before anything is queued.

Every field of OpenAI's images API and this server's extensions (``seed``, ``steps``,
``guidance``, ``negative_prompt``, ``lora``). Honoured: ``prompt``, ``n``, ``size`` (``auto``: the
default), ``response_format`` (``b64_json``), ``model``, ``output_format`` (png, jpeg, webp) and
``output_compression`` (jpeg and webp). Accepted and ignored (:data:`IGNORED`): what a diffusion
model here has no setting for (``quality``, ``style``, ``background``, ``moderation``, ...); the
request lists them (``ignored``), and the route says so in the log and the
``X-Ignored-Parameters`` header. ``stream: true`` (with ``partial_images``, 0 to 3, and ``n`` 1) is
served where the server streams (``--batching continuous``; else a 400); without it
``partial_images`` is ignored. A body that is not
UTF-8, not JSON or not an object, a field of the wrong type, out of range, or naming what this
server does not serve (a size, an adapter, a model, a format) is a 400, as OpenAI answers an
invalid request (its client raises ``BadRequestError``): one line naming the field, and nothing
reaches the queue.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

# The generation core's limits: torch.Generator.manual_seed's range (image i of a request uses seed + i), and
# the built-in schedulers' num_train_timesteps (the engine checks the model's own).
from pipelines.generation.constants import MAX_GUIDANCE, MAX_SEED, MAX_STEPS

from .errors import ServeError

__all__ = [
    "IGNORED",
    "MAX_BODY_BYTES",
    "MAX_GUIDANCE",
    "MAX_PARTIAL_IMAGES",
    "MAX_PROMPT_CHARS",
    "MAX_SEED",
    "MAX_STEPS",
    "ImageRequest",
    "Served",
    "check_fields",
    "parse_request",
]

MAX_BODY_BYTES = 1 << 20  # a prompt is text: a megabyte is far beyond any text encoder's reach
# Characters of a prompt or negative prompt. The text encoders read 512 tokens at most (the CLI
# cuts longer prompts there); the routes measure every prompt's length, and a longer text would
# only hold up the event loop in the tokenizer.
MAX_PROMPT_CHARS = 16384
# OpenAI's fields that no setting of these pipelines matches: accepted (its client sends them),
# ignored, and said to be. ``user`` and ``safety_identifier`` are ids for OpenAI's abuse tracking.
IGNORED = (
    "quality",
    "style",
    "background",
    "moderation",
    "complexity",
    "partial_images",
    "frame_count",
    "frame_duration_ms",
    "svg",
    "user",
    "safety_identifier",
)
FORMATS = ("png", "jpeg", "webp")
MAX_PARTIAL_IMAGES = 3  # OpenAI's


@dataclasses.dataclass(frozen=True)
class Served:
    """What this server serves, which a request is checked against.

    ``model``: the id the model is listed and answered under; ``aliases``: other names a request
    may give it by (``--served-model-name``'s others, the name as ``--model`` gave it); ``sizes``:
    ``(width, height)`` pairs, the first the default; ``max_n``: images per request (the largest
    batch size); ``loras``: adapter names loaded at start; ``cold``: sizes of ``--resolutions``
    that the warm-up did not capture and are not served (no ``--capture-on-miss``);
    ``batch_sizes``: the buckets; ``max_steps``: the most steps a request may ask for
    (``--max-steps``); ``stream``: requests may stream (``--batching continuous``).
    """

    model: str
    sizes: tuple[tuple[int, int], ...]
    max_n: int
    loras: tuple[str, ...] = ()
    cold: tuple[tuple[int, int], ...] = ()
    batch_sizes: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()
    max_steps: int = MAX_STEPS
    stream: bool = False

    @property
    def size_names(self) -> list[str]:
        return [f"{w}x{h}" for w, h in self.sizes]

    def serves(self, model: str) -> bool:
        """Whether a request naming ``model`` asks for this server's model."""
        return model == self.model or model in self.aliases


@dataclasses.dataclass(frozen=True)
class ImageRequest:
    """A checked request. None: the model's default (steps, guidance), no negative prompt, no
    adapter, or a random seed (drawn when the request is planned). An edit's ``image`` and
    ``mask`` (PIL), its ``strength`` and how its images' record names the input (``image_note``):
    :mod:`.edits`. ``stream``: answered as server-sent events, ``partial_images`` previews first."""

    prompt: str
    n: int
    width: int
    height: int
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    lora: str | None = None
    output_format: str = "png"
    output_compression: int | None = None
    ignored: tuple[str, ...] = ()
    image: Any = dataclasses.field(default=None, compare=False)
    mask: Any = dataclasses.field(default=None, compare=False)
    strength: float | None = None
    image_note: str | None = None
    stream: bool = False
    partial_images: int = 0


class _Body(BaseModel):
    # strict: "n": "2" or "n": true is a mistake to name, not a value to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    n: int = 1
    size: str | None = None
    response_format: str = "b64_json"
    model: str | None = None
    output_format: str | None = None
    output_compression: int | None = None
    stream: bool | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    complexity: str | None = None
    partial_images: int | None = None
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    lora: str | None = None


def _decode(body: bytes) -> object:
    if len(body) > MAX_BODY_BYTES:
        raise ServeError(413, f"the body is {len(body)} bytes; at most {MAX_BODY_BYTES}", code="body_too_large")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ServeError(
            400, f"the body is not UTF-8 text (byte 0x{body[e.start]:02x} at offset {e.start})", code="invalid_body"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeError(400, f"the body is not JSON: {e.msg} at line {e.lineno} column {e.colno}",
                         code="invalid_json") from None  # fmt: skip


def _text(name: str, value: str) -> str:
    """``value`` if it is valid Unicode text of at most :data:`MAX_PROMPT_CHARS` characters; JSON
    can escape lone surrogates (``"\\ud800"``) and NUL (``"\\u0000"``), which no tokenizer takes
    and no PNG text chunk can hold."""
    if len(value) > MAX_PROMPT_CHARS:
        raise ServeError(400, f"{name} is {len(value)} characters; at most {MAX_PROMPT_CHARS} (the text encoder "
                         "reads 512 tokens)", param=name, code="text_too_long")  # fmt: skip
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ServeError(400, f"{name} is not valid UTF-8 text (U+{ord(value[e.start]):04X} at character {e.start})",
                         param=name, code="invalid_text") from None  # fmt: skip
    nul = value.find("\0")
    if nul >= 0:  # no tokenizer means it, and the image's record (PNG text) cannot hold it
        raise ServeError(400, f"{name} holds a NUL character (U+0000) at character {nul}", param=name,
                         code="invalid_text")  # fmt: skip
    return value


def _size(text: str | None, served: Served) -> tuple[int, int]:
    if text is None or text == "auto":
        return served.sizes[0]
    parts = text.lower().split("x")
    size = tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else None
    if size in served.cold:
        raise ServeError(400, f"size {text!r} was not warmed up (served: {', '.join(served.size_names)}; "
                         "bcg-serve --capture-on-miss serves it by capturing its first call)", param="size",
                         code="size_not_warm")  # fmt: skip
    if size not in served.sizes:
        what = "is not served" if size is not None else "is not WIDTHxHEIGHT"
        raise ServeError(400, f"size {text!r} {what} (served: {', '.join(served.size_names)})",
                         param="size", code="unknown_size")  # fmt: skip
    return size  # type: ignore[return-value]


def _format(b: _Body) -> tuple[str, int | None, list[str]]:
    """The output format, its compression, and what of them is ignored."""
    fmt = b.output_format or "png"
    if fmt not in FORMATS:
        raise ServeError(400, f"output_format {fmt!r} is not served: one of {', '.join(FORMATS)}",
                         param="output_format", code="unsupported_output_format")  # fmt: skip
    compression = b.output_compression
    if compression is not None and not 0 <= compression <= 100:
        raise ServeError(400, f"output_compression must be 0 to 100, got {compression}", param="output_compression",
                         code="invalid_value")  # fmt: skip
    if compression is not None and fmt == "png":  # OpenAI's too: PNG is lossless, its compression no choice here
        return fmt, None, ["output_compression"]
    return fmt, compression, []


def parse_request(body: bytes, served: Served) -> ImageRequest:
    """The raw body -> an :class:`ImageRequest`, or :class:`ServeError` (400 or 413)."""
    data = _decode(body)
    if not isinstance(data, dict):
        raise ServeError(400, f"the body must be a JSON object, not {type(data).__name__}", code="invalid_body")
    return check_fields(data, served)


def check_fields(data: dict[str, Any], served: Served, body: type[BaseModel] | None = None) -> ImageRequest:
    """A request's fields -> an :class:`ImageRequest`, or :class:`ServeError` (400): checked as
    ``body`` (default: a generation request's fields) and against ``served``."""
    try:
        b: Any = (body or _Body).model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ServeError(400, f"{param}: {first['msg']}{more}", param=param, code="invalid_value") from None
    prompt = _text("prompt", b.prompt)
    if not prompt.strip():
        raise ServeError(400, "prompt is empty", param="prompt", code="empty_prompt")
    if not 1 <= b.n <= served.max_n:
        raise ServeError(400, f"n must be 1 to {served.max_n} (this server's largest batch size), got {b.n}",
                         param="n", code="n_out_of_range")  # fmt: skip
    width, height = _size(b.size, served)
    stream = bool(b.stream)
    if stream and not served.stream:
        raise ServeError(400, "stream is not served: the images come in one answer (bcg-serve --batching continuous "
                         "streams them)", param="stream", code="unsupported_stream")  # fmt: skip
    if stream and b.n != 1:
        raise ServeError(400, f"stream takes n=1 (one image's events), got {b.n}", param="n", code="invalid_value")
    partials = b.partial_images or 0
    if not 0 <= partials <= MAX_PARTIAL_IMAGES:
        raise ServeError(400, f"partial_images must be 0 to {MAX_PARTIAL_IMAGES}, got {partials}",
                         param="partial_images", code="invalid_value")  # fmt: skip
    fmt, compression, ignored = _format(b)
    honoured = ("partial_images",) if stream else ()  # without stream there is nothing to send them in
    ignored = [name for name in IGNORED if getattr(b, name) is not None and name not in honoured] + ignored
    if b.response_format != "b64_json":
        raise ServeError(400, f"response_format {b.response_format!r} is not served: only 'b64_json' (no image "
                         "store to link to)", param="response_format", code="unsupported_response_format")  # fmt: skip
    if b.model is not None and not served.serves(b.model):
        names = ", ".join(repr(n) for n in (served.model, *served.aliases))
        raise ServeError(400, f"model {b.model!r} is not served; this server serves {names} (bcg-serve "
                         "--served-model-name names it)", param="model", code="model_not_found")  # fmt: skip
    if b.seed is not None and not 0 <= b.seed <= MAX_SEED - (b.n - 1):
        raise ServeError(400, f"seed must be 0 to {MAX_SEED - (b.n - 1)} (image i uses seed + i), got {b.seed}",
                         param="seed", code="invalid_value")  # fmt: skip
    if b.steps is not None and not 1 <= b.steps <= served.max_steps:
        most = "" if served.max_steps == MAX_STEPS else " (this server's --max-steps)"
        raise ServeError(400, f"steps must be 1 to {served.max_steps}{most}, got {b.steps}", param="steps",
                         code="invalid_value")  # fmt: skip
    if b.guidance is not None and not (math.isfinite(b.guidance) and 0 <= b.guidance <= MAX_GUIDANCE):
        raise ServeError(400, f"guidance must be a number from 0 to {MAX_GUIDANCE:g}, got {b.guidance:g}",
                         param="guidance", code="invalid_value")  # fmt: skip
    negative = _text("negative_prompt", b.negative_prompt) if b.negative_prompt is not None else None
    if b.lora is not None and b.lora not in served.loras:
        known = ", ".join(served.loras) if served.loras else "none are loaded (bcg-serve --lora NAME=FILE)"
        raise ServeError(400, f"lora {b.lora!r} is not loaded (loaded: {known})", param="lora", code="unknown_adapter")
    return ImageRequest(prompt=prompt, n=b.n, width=width, height=height, seed=b.seed, steps=b.steps,
                        guidance=b.guidance, negative_prompt=negative, lora=b.lora, output_format=fmt,
                        output_compression=compression, ignored=tuple(ignored), stream=stream,
                        partial_images=partials if stream else 0)  # fmt: skip
