"""The request body's checks, without a server: each bad input is refused with its status, the
field named and one line; a good one comes out with the served defaults."""

from __future__ import annotations

import json

import pytest

from pipelines.serve.errors import ServeError
from pipelines.serve.schema import MAX_SEED, ImageRequest, Served, parse_request

SERVED = Served(
    model="z-image", sizes=((64, 64), (32, 48)), max_n=4, loras=("style",), cold=((32, 32),), aliases=("zimage",)
)


def parse(body: object) -> ImageRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, SERVED)


def test_a_good_request_keeps_its_values_and_takes_the_defaults() -> None:
    assert parse({"prompt": "a fox"}) == ImageRequest("a fox", 1, 64, 64)
    r = parse({"prompt": "a fox", "n": 4, "size": "32x48", "seed": 7, "steps": 3, "guidance": 2,
               "negative_prompt": "", "lora": "style", "response_format": "b64_json", "model": "z-image",
               "user": "u1"})  # fmt: skip
    assert r == ImageRequest("a fox", 4, 32, 48, seed=7, steps=3, guidance=2.0, negative_prompt="", lora="style",
                             ignored=("user",))  # fmt: skip
    assert parse({"prompt": "x", "n": 2, "seed": MAX_SEED - 1}).seed == MAX_SEED - 1  # the last image's seed fits


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        (b"\xff{}", 400, None, "not UTF-8 text (byte 0xff at offset 0)"),
        (b"{prompt: 1}", 400, None, "not JSON"),
        (b"", 400, None, "not JSON"),
        ([1, 2], 400, None, "must be a JSON object, not list"),
        ({}, 400, "prompt", "prompt: Field required"),
        ({"prompt": ""}, 400, "prompt", "prompt is empty"),
        ({"prompt": " \n\t"}, 400, "prompt", "prompt is empty"),
        (b'{"prompt": "a \\ud800 fox"}', 400, "prompt", "not valid UTF-8 text (U+D800 at character 2)"),
        ({"prompt": 5}, 400, "prompt", "valid string"),
        ({"prompt": "x", "n": 0}, 400, "n", "n must be 1 to 4"),
        ({"prompt": "x", "n": 5}, 400, "n", "n must be 1 to 4"),
        ({"prompt": "x", "n": "2"}, 400, "n", "valid integer"),
        ({"prompt": "x", "n": True}, 400, "n", "valid integer"),
        ({"prompt": "x", "size": "100x100"}, 400, "size", "'100x100' is not served (served: 64x64, 32x48)"),
        ({"prompt": "x", "size": "big"}, 400, "size", "is not WIDTHxHEIGHT"),
        ({"prompt": "x", "response_format": "url"}, 400, "response_format", "only 'b64_json'"),
        ({"prompt": "x", "model": "dall-e-3"}, 400, "model", "not served"),
        ({"prompt": "x", "seed": -1}, 400, "seed", "seed must be 0 to"),
        ({"prompt": "x", "n": 2, "seed": MAX_SEED}, 400, "seed", "image i uses seed + i"),
        ({"prompt": "x", "steps": 0}, 400, "steps", "steps must be 1 to 1000"),
        (b'{"prompt": "x", "guidance": NaN}', 400, "guidance", "a number from 0 to 100"),
        ({"prompt": "x", "guidance": -1}, 400, "guidance", "a number from 0 to 100"),
        ({"prompt": "x", "guidance": 1e308}, 400, "guidance", "a number from 0 to 100, got 1e+308"),
        ({"prompt": "x\u0000y"}, 400, "prompt", "prompt holds a NUL character (U+0000) at character 1"),
        ({"prompt": "x", "negative_prompt": "\u0000"}, 400, "negative_prompt", "holds a NUL character"),
        ({"prompt": "x", "model": "zimage-tiny"}, 400, "model", "serves 'z-image', 'zimage' (bcg-serve --served"),
        (b'{"prompt": "x", "negative_prompt": "\\udcff"}', 400, "negative_prompt", "not valid UTF-8"),
        ({"prompt": "x", "lora": "other"}, 400, "lora", "'other' is not loaded (loaded: style)"),
        ({"prompt": "x", "quality": 5}, 400, "quality", "valid string"),
        ({"prompt": "x", "output_format": "gif"}, 400, "output_format", "'gif' is not served: one of png, jpeg, webp"),
        ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, 400, "output_compression", "0 to 100"),
        ({"prompt": "x", "stream": True}, 400, "stream", "stream is not served"),
        (
            {"prompt": "x", "size": "32x32"},
            400,
            "size",
            "'32x32' was not warmed up (served: 64x64, 32x48; bcg-serve --capture-on-miss",
        ),
        ({"prompt": "x", "colour": "red"}, 400, "colour", "Extra inputs are not permitted"),
        ({"prompt": "x" * 16385}, 400, "prompt", "prompt is 16385 characters; at most 16384"),
        ({"prompt": "x", "negative_prompt": "y" * 20000}, 400, "negative_prompt", "at most 16384"),
    ],
)
def test_bad_input_is_refused_in_one_line_naming_the_field(body: object, status: int, param: str | None,
                                                           says: str) -> None:  # fmt: skip
    with pytest.raises(ServeError) as e:
        parse(body)
    assert (e.value.status, e.value.param) == (status, param)
    assert says in e.value.message
    line = e.value.json()
    assert b"\n" not in line
    assert json.loads(line)["error"]["message"] == e.value.message


def test_every_field_openais_client_sends_is_accepted_and_the_unhonoured_ones_are_named() -> None:
    fields = dict(quality="hd", style="vivid", background="opaque", moderation="low", complexity="low",
                  partial_images=0, frame_count=1, frame_duration_ms=10, svg={}, user="u", safety_identifier="s",
                  stream=False, size="auto", output_format="webp", output_compression=40)  # fmt: skip
    r = parse({"prompt": "a fox", **fields})
    assert (r.width, r.height, r.output_format, r.output_compression) == (64, 64, "webp", 40)
    assert set(r.ignored) == set(fields) - {"stream", "size", "output_format", "output_compression"}
    png = parse({"prompt": "a fox", "output_format": "png", "output_compression": 50})
    assert (png.output_format, png.output_compression, png.ignored) == ("png", None, ("output_compression",))
    assert parse({"prompt": "a fox"}).ignored == ()


def test_the_model_is_asked_for_by_its_id_or_an_alias_and_steps_within_max_steps() -> None:
    assert parse({"prompt": "x", "model": "zimage"}).prompt == "x"
    capped = Served(model="z-image", sizes=((64, 64),), max_n=1, max_steps=50)
    assert parse_request(b'{"prompt": "x", "steps": 50}', capped).steps == 50
    with pytest.raises(ServeError, match=r"steps must be 1 to 50 \(this server's --max-steps\), got 51"):
        parse_request(b'{"prompt": "x", "steps": 51}', capped)


def test_a_body_past_the_limit_is_refused_unread() -> None:
    with pytest.raises(ServeError) as e:
        parse_request(b" " * ((1 << 20) + 1), SERVED)
    assert e.value.status == 413


def test_no_adapters_loaded_says_how_to_load_one() -> None:
    with pytest.raises(ServeError, match=r"none are loaded \(bcg-serve --lora NAME=FILE\)"):
        parse_request(b'{"prompt": "x", "lora": "style"}', Served("z-image", ((64, 64),), 1))
