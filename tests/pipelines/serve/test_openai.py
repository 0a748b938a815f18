"""OpenAI's own Python client (the ``openai`` package, a test dependency) against a real
``bcg-serve`` process on a loopback port: ``images.generate`` with every parameter the images API
takes. ``output_format`` png, jpeg and webp come back as those files (their magic bytes) and
``output_compression`` is honoured; the parameters no setting here matches are accepted, and
named in the log and the ``X-Ignored-Parameters`` header; a prompt cut at the text encoder's
limit is logged and the response says so (a header, and ``prompt_truncated`` on each image);
what is not served is the client's own ``BadRequestError`` (a 400, as OpenAI answers) with a
one-line message."""

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
