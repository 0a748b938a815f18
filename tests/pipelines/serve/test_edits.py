"""``POST /v1/images/edits`` on an edit model: a tiny FLUX.1 Kontext saved as a pipeline folder,
served from it as a user's download would be, driven by OpenAI's own client. Its own call takes
the image (nothing names the model: its pipeline's call has ``image``), at the size asked, and it
still makes images from text alone (diffusers lists it among text-to-image pipelines)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from tests.pipelines.serve.server import ServerProcess

FAST = {"steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from diffusers import FluxKontextPipeline

    from pipelines.builders import build_pipeline

    folder = tmp_path_factory.mktemp("models") / "kontext-tiny"
    FluxKontextPipeline.from_pipe(build_pipeline("flux", "tiny")).save_pretrained(folder)
    s = ServerProcess(["--model", str(folder), "--resolutions", "32x32", "--device", "cpu", "--batch-sizes", "1", "2"],
                      tmp_path_factory.mktemp("edits") / "server.log")  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Any]:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield c
    c.close()


def png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 40), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def image_of(item: Any) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    image.load()
    return image


def test_an_edit_model_takes_the_image_through_its_own_call(server: ServerProcess, client: Any) -> None:
    assert "edits (POST /v1/images/edits) through FluxKontextPipeline (edit)" in server.text()
    (model,) = client.models.list().data
    assert model.id == "kontext-tiny"  # the folder's name, not its path
    r = client.images.edit(image=("in.png", png((200, 30, 30)), "image/png"), prompt="make it blue", n=2,
                           model="kontext-tiny", extra_body=FAST)  # fmt: skip
    images = [image_of(item) for item in r.data]
    assert [im.size for im in images] == [(32, 32), (32, 32)]  # the size asked, not the model's 1024x1024
    assert images[0].text["input_image"].endswith("(48x40), edit") and images[1].text["seed"] == "2"
    made = image_of(client.images.generate(prompt="a red fox", extra_body=FAST).data[0])
    assert made.size == (32, 32) and "input_image" not in made.text  # text alone works too


def test_what_an_edit_model_does_not_take_is_a_bad_request(client: Any, tmp_path: Path) -> None:
    with pytest.raises(openai.BadRequestError, match="strength: FluxKontextPipeline takes none"):
        client.images.edit(image=("in.png", png((1, 2, 3)), "image/png"), prompt="x",
                           extra_body={**FAST, "strength": 0.5})  # fmt: skip
