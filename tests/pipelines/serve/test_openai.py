"""OpenAI's own Python client (the ``openai`` package, a test dependency) against a real
``bcg-serve`` process on a loopback port: ``images.generate`` with every parameter the images API
takes. ``output_format`` png, jpeg and webp come back as those files (their magic bytes) and
``output_compression`` is honoured; the parameters no setting here matches are accepted, and
named in the log and the ``X-Ignored-Parameters`` header; a prompt cut at the text encoder's
limit is logged and the response says so (a header, and ``prompt_truncated`` on each image);
what is not served is the client's own ``BadRequestError`` (a 400, as OpenAI answers) with a
one-line message. ``images.edit`` sends its multipart form to ``/v1/images/edits``: the tiny
Z-Image-style model takes the image through the image-to-image pipeline diffusers makes from it
(and a mask through its inpainting pipeline), recorded in each image's text."""

from __future__ import annotations

import base64
import inspect
import io
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from PIL import Image

from pipelines.serve.schema import IGNORED, ImageRequest
from tests.pipelines.serve.server import TINY, ServerProcess

# The client's own arguments, not the API's.
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
FAST = {"steps": 1, "seed": 3}  # this server's extensions, through the client's extra_body
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff"}  # WebP: RIFF, 4 bytes of length, WEBP


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess([*TINY, "--batch-sizes", "1", "2", "4"], tmp_path_factory.mktemp("openai") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Any]:
    # No retries: a failure is the test's to see, not the client's to hide by asking again.
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield c
    c.close()


def raw_bytes(item: Any) -> bytes:
    return base64.b64decode(item.b64_json)


def is_format(data: bytes, fmt: str) -> bool:
    if fmt == "webp":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return data.startswith(MAGIC[fmt])


def test_every_parameter_of_the_images_api_is_accepted_and_the_ignored_ones_are_named(
    server: ServerProcess, client: Any
) -> None:
    raw = client.images.with_raw_response.generate(
        model="z-image", prompt="a red fox", n=2, size="32x32", response_format="b64_json", user="someone",
        quality="standard", style="vivid", output_format="png", output_compression=80, background="opaque",
        moderation="auto", extra_body=FAST,
    )  # fmt: skip
    response = raw.parse()
    assert len(response.data) == 2 and all(is_format(raw_bytes(d), "png") for d in response.data)
    assert [d.model_extra["seed"] for d in response.data] == [3, 4]
    named = raw.headers["x-ignored-parameters"].split(", ")
    assert named == ["quality", "style", "background", "moderation", "user", "output_compression"]
    assert f"accepted and ignored: {', '.join(named)}" in server.text()


def test_every_parameter_the_installed_client_sends_is_known_to_the_server(client: Any) -> None:
    """The client's ``generate`` keyword arguments, whatever its version: each is a field this
    server honours or names as ignored (``stream`` is refused: the images come in one answer)."""
    sent = set(inspect.signature(client.images.generate).parameters) - CLIENT_ONLY
    honoured = {f.name for f in ImageRequest.__dataclass_fields__.values()} | {"size", "response_format", "model"}
    assert sent - honoured - set(IGNORED) - {"stream"} == set()


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_output_format_is_honoured(client: Any, fmt: str) -> None:
    response = client.images.generate(prompt="a lighthouse", size="64x64", output_format=fmt, extra_body=FAST)
    data = raw_bytes(response.data[0])
    assert is_format(data, fmt), data[:16]
    assert response.output_format == fmt
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.size) == ({"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt], (64, 64))


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_output_compression_changes_the_lossy_files(client: Any, fmt: str) -> None:
    def made(compression: int) -> bytes:
        r = client.images.generate(prompt="a lighthouse", size="64x64", output_format=fmt,
                                   output_compression=compression, extra_body=FAST)  # fmt: skip
        return raw_bytes(r.data[0])

    assert len(made(10)) < len(made(100))


def test_a_prompt_cut_at_the_text_encoders_limit_is_logged_and_said(server: ServerProcess, client: Any) -> None:
    long = " ".join(["a red fox in the snow"] * 150)  # 1958 tokens in the tiny Z-Image's template; it reads 512
    raw = client.images.with_raw_response.generate(prompt=long, size="32x32", extra_body=FAST)
    item = raw.parse().data[0]
    cut = item.model_extra["prompt_truncated"]
    assert cut["read"] == 512 and cut["tokens"] > 512
    assert raw.headers["x-prompt-truncated"] == f"{cut['tokens']} tokens, the first 512 read"
    assert f"a prompt of {cut['tokens']} tokens was cut at the text encoder's 512" in server.text()
    short = client.images.with_raw_response.generate(prompt="a red fox", size="32x32", extra_body=FAST)
    assert "x-prompt-truncated" not in short.headers and "prompt_truncated" not in short.parse().data[0].model_extra


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(size="1024x1024"), "size '1024x1024' is not served (served: 64x64, 32x32)"),
        (dict(n=5), "n must be 1 to 4 (this server's largest batch size), got 5"),
        (dict(output_format="gif"), "output_format 'gif' is not served: one of png, jpeg, webp"),
        (dict(response_format="url"), "response_format 'url' is not served: only 'b64_json'"),
        (dict(model="dall-e-3"), "model 'dall-e-3' is not served; this server serves 'z-image'"),
        (dict(extra_body={"guidance": 1e308}), "guidance must be a number from 0 to 100"),
    ],
)
def test_what_is_not_served_is_the_clients_own_error_in_one_line(client: Any, kwargs: dict[str, Any],
                                                                  says: str) -> None:  # fmt: skip
    body = {**FAST, **kwargs.get("extra_body", {})}
    rest = {key: value for key, value in kwargs.items() if key != "extra_body"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", extra_body=body, **rest)
    error = refused.value.body
    assert says in error["message"] and "\n" not in error["message"], error


def png_file(size: tuple[int, int] = (64, 48), mode: str = "RGB", colour: tuple[int, ...] = (200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_images_edit_through_the_official_client_returns_an_image_of_the_input(client: Any) -> None:
    red, blue = png_file(), png_file(colour=(30, 60, 220))

    def edit(image: bytes, **extra: Any) -> Image.Image:  # 4 steps at strength 0.5: the last 2, from the image
        r = client.images.edit(image=("in.png", image, "image/png"), prompt="a lighthouse", size="64x64",
                               extra_body={**FAST, "steps": 4, "strength": 0.5, **extra})  # fmt: skip
        (item,) = r.data
        with Image.open(io.BytesIO(raw_bytes(item))) as out:
            out.load()
            return out

    from_red = edit(red)
    assert from_red.size == (64, 64) and from_red.format == "PNG"
    text = from_red.text
    assert text["input_image"].endswith("(64x48), img2img, strength 0.5") and "Denoising strength: 0.5" in text[
        "parameters"]  # fmt: skip
    assert (text["prompt"], text["seed"], text["steps"]) == ("a lighthouse", "3", "4")
    import numpy as np

    pixels = np.asarray(from_red, dtype=np.int16)
    assert np.array_equal(pixels, np.asarray(edit(red), dtype=np.int16))  # its seed's, again
    assert not np.array_equal(pixels, np.asarray(edit(blue), dtype=np.int16))  # and its image's


def test_an_edit_with_openais_mask_goes_to_the_inpainting_pipeline(client: Any) -> None:
    mask = Image.new("RGBA", (64, 48), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 48))  # the left half transparent: redrawn
    buffer = io.BytesIO()
    mask.save(buffer, format="PNG")
    r = client.images.edit(image=("in.png", png_file(), "image/png"), mask=("mask.png", buffer.getvalue(), "image/png"),
                           prompt="a lighthouse", size="32x32", extra_body=FAST)  # fmt: skip
    with Image.open(io.BytesIO(raw_bytes(r.data[0]))) as out:
        out.load()
        assert out.size == (32, 32) and out.text["input_image"].endswith("(64x48), masked, inpaint")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(size="48x48"), "size '48x48' is not served"),
        (dict(n=9), "n must be 1 to 4"),
        (dict(extra_body={"strength": 1.5}), "strength must be above 0 and at most 1, got 1.5"),
        (dict(extra_body={"steps": "many"}), "steps: Input should be a valid integer"),
        (dict(image=("in.png", b"not an image", "image/png")), "image is not an image this server can read"),
    ],
)
def test_an_invalid_edit_is_the_clients_bad_request(client: Any, kwargs: dict[str, Any], says: str) -> None:
    args: dict[str, Any] = dict(image=("in.png", png_file(), "image/png"), prompt="a fox", size="64x64")
    args.update(kwargs)
    args["extra_body"] = {**FAST, **kwargs.get("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(**args)
    assert says in refused.value.body["message"] and "\n" not in refused.value.body["message"]


def test_an_edit_form_without_an_image_or_not_multipart_is_a_400(server: ServerProcess) -> None:
    no_image = server.client.post("/v1/images/edits", data={"prompt": "a fox"}, files={"x": ("x", b"1")})
    assert no_image.status_code == 400 and no_image.json()["error"]["param"] == "image"
    as_json = server.client.post("/v1/images/edits", json={"prompt": "a fox"})
    assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
