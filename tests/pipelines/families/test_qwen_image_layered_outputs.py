"""Qwen-Image Layered's output as the front ends give it: every layer of every image, RGBA.

The pipeline returns, per input image, a list of layer images with alpha. ``bcg-generate`` writes
each layer as a file of its own (``NAME-layerK.png``) and says so in its last line;
``bcg-serve``'s ``/v1/images/edits`` answers each layer as a ``data`` item (``n`` images times
the layers, in order). The tiny pipeline at a scaled-down size (tests/helpers/small_layers.py),
the server's on emulated CUDA graphs (its calls replay them; ``bcg-generate`` warms up only on a
CUDA device, so on a CPU its call runs eagerly), each compared with the stock pipeline called
eagerly with the same arguments, pixel for pixel, alpha included. A format without alpha is
refused in one line, never written with the alpha dropped.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.builders import build_pipeline
from tests.helpers.small_layers import shrink_layers

pytestmark = pytest.mark.usefixtures("few_threads")

PROMPT, NEGATIVE, STEPS, SEED, N = "a red fox in the snow", "blurry", 2, 7, 2
INPUT = (64, 48)  # the input image's size (width, height); the layers are 96x64
LAYERS = 4  # the pipeline's default: neither front end passes ``layers``


def _input(seed: int = 3) -> Image.Image:
    """An RGBA input image whose alpha varies, so a lost alpha channel would show."""
    pixels = torch.randint(0, 256, (INPUT[1], INPUT[0], 4), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy(), mode="RGBA")


def _stock_layers(image: Image.Image) -> list[np.ndarray]:
    """The stock pipeline's layers for N images of ``image``, eagerly, in its order."""
    pipe = build_pipeline("qwen-image-layered", "tiny")
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=STEPS,
               num_images_per_prompt=N, generator=[torch.Generator().manual_seed(SEED + i) for i in range(N)]).images  # fmt: skip
    layers = [np.asarray(layer) for stack in out for layer in stack]
    assert len(layers) == N * LAYERS and all(a.shape[-1] == 4 for a in layers)
    assert any(len(np.unique(a[..., 3])) > 1 for a in layers), "the alpha is flat: the test would not see it lost"
    return layers


def _read(data: bytes | Path) -> Image.Image:
    image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    image.load()
    return image


def test_bcg_generate_writes_every_layer_as_an_rgba_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from pipelines.cli import main

    shrink_layers(monkeypatch)
    want = _stock_layers(_input())
    _input().save(tmp_path / "in.png")
    out = tmp_path / "out"
    argv = ["--model", "qwen-image-layered", "--image", str(tmp_path / "in.png"), "--prompt", PROMPT,
            "--negative-prompt", NEGATIVE, "--guidance", "4", "--steps", str(STEPS), "--seed", str(SEED),
            "--batch-size", str(N), "--device", "cpu", "--out", str(out), "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    names = [Path(f["file"]).name for f in summary["files"]]
    stems = [f"{i:04d}-a-red-fox-in-the-snow-{INPUT[0]}x{INPUT[1]}-s{SEED + i}" for i in range(N)]
    assert names == [f"{s}-layer{k}.png" for s in stems for k in range(LAYERS)]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # nothing else written
    assert [f["layer"] for f in summary["files"]] == list(range(LAYERS)) * N and summary["made"] == N
    assert f"each image as {LAYERS} RGBA layers: NAME-layer0.png to NAME-layer{LAYERS - 1}.png" in captured.err
    for name, pixels in zip(names, want):
        image = _read(out / name)
        assert image.mode == "RGBA" and image.size == (96, 64), name
        assert np.array_equal(np.asarray(image), pixels), name
        assert image.text["layer"] == name[-5] and image.text["layers"] == str(LAYERS)

    jpeg = main([*argv[:-4], "--out", str(tmp_path / "j"), "--format", "jpeg", "--quiet"])
    assert jpeg == 2 and "JPEG has no alpha" in capsys.readouterr().err
    assert not (tmp_path / "j").exists()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.pipelines.serve.server import ServerProcess

    s = ServerProcess(["--model", "qwen-image-layered", "--resolutions", f"{INPUT[0]}x{INPUT[1]}", "--device", "cpu",
                       "--batch-sizes", "1", str(N), "--capture-on-miss"], tmp_path_factory.mktemp("layered") / "server.log",
                      command=[sys.executable, "-m", "tests.helpers.small_layers"])  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_bcg_serve_answers_every_layer_of_every_image(server, monkeypatch: pytest.MonkeyPatch) -> None:
    shrink_layers(monkeypatch)
    torch.set_num_threads(1)  # as the server's process runs (few_threads restores it)
    want = _stock_layers(_input())
    form = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "guidance": "4", "steps": str(STEPS), "seed": str(SEED),
            "n": str(N)}  # fmt: skip
    # Twice: the first call captures what its prompt's length needs (the warm-up's prompts are the
    # server's own, and Layered's text is not padded to a length it warmed up), the second replays.
    for attempt in range(2):
        before = server.metrics()
        r = server.client.post("/v1/images/edits", data=form, files={"image": ("in.png", _png(_input()), "image/png")})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert r.json()["size"] == "96x64"  # what the pipeline made from the 64x48 input, not the request's
        assert [(d["seed"], d["layer"]) for d in data] == [(SEED + i, k) for i in range(N) for k in range(LAYERS)]
        for d, pixels in zip(data, want, strict=True):
            image = _read(base64.b64decode(d["b64_json"]))
            assert image.mode == "RGBA" and np.array_equal(np.asarray(image), pixels), (attempt, d["seed"], d["layer"])
            assert image.text["layer"] == str(d["layer"]) and image.text["layers"] == str(LAYERS)
            assert image.text["resolution"] == "96x64" and "Size: 96x64" in image.text["parameters"]
        after = server.metrics()
        assert after["bcg_serve_images_total"] - before["bcg_serve_images_total"] == N  # images; layers are files
    replay, eager = (f'bcg_serve_denoiser_calls_total{{kind="{k}"}}' for k in ("replay", "eager"))
    assert after[replay] - before[replay] == STEPS * 2 and after[eager] == before[eager]  # true CFG: 2 a step

    r = server.client.post("/v1/images/edits", data={**form, "output_format": "jpeg"},
                           files={"image": ("in.png", _png(_input()), "image/png")})  # fmt: skip
    assert r.status_code == 400 and "jpeg has no alpha" in r.json()["error"]["message"]
