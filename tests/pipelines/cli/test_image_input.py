"""Input images (``--image``, ``--mask``, ``--strength``; :mod:`pipelines.generation.image_input`) on the
CPU: a text-to-image model takes one through the image-to-image (or inpainting) pipeline diffusers
makes of its components, an edit model (a pipeline folder of FLUX.1 Kontext, tiny) through its own
call, and each image's record says which; which models need an image, from diffusers' own lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from diffusers import (
    FluxKontextPipeline,
    QwenImageEditPipeline,
    QwenImageLayeredPipeline,
    QwenImagePipeline,
    ZImageImg2ImgPipeline,
    ZImagePipeline,
)
from PIL import Image

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.generation.errors import InputError
from pipelines.generation.formats import read_image_text
from pipelines.generation.image_input import IMG2IMG, INPAINT, fitted, image_pipeline, mask_from, needs_image

FAST = ["--steps", "4", "--quiet"]


def picture(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (80, 48)) -> Path:
    image = Image.new("RGB", size, colour)
    image.paste((255, 255, 255), (10, 10, 40, 30))
    image.save(path)
    return path


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def test_which_models_need_an_image_is_diffusers_word() -> None:
    assert needs_image(QwenImageEditPipeline) and needs_image(QwenImageLayeredPipeline)
    assert not needs_image(FluxKontextPipeline)  # also makes images from text
    assert not needs_image(ZImagePipeline) and not needs_image(QwenImagePipeline)  # take none of their own


def test_a_text_to_image_model_takes_an_image_through_diffusers_image_to_image_pipeline() -> None:
    pipe = build_pipeline("z-image", "tiny")
    taking = image_pipeline(pipe)
    assert isinstance(taking.pipe, ZImageImg2ImgPipeline) and taking.kind == IMG2IMG and taking.strength
    assert taking.pipe.transformer is pipe.transformer  # the same modules: the same weights and graphs
    assert image_pipeline(pipe, mask=True).kind == INPAINT
    with pytest.raises(InputError, match="WanPipeline takes no input image, and diffusers makes no img2img pipeline"):
        image_pipeline(build_pipeline("wan", "tiny"))


def test_openais_mask_and_a_grey_mask_read_alike_and_images_fit_the_call() -> None:
    openai_mask = Image.new("RGBA", (4, 2), (0, 0, 0, 255))
    openai_mask.putpixel((0, 0), (0, 0, 0, 0))  # transparent: redrawn
    grey = Image.new("L", (4, 2), 0)
    grey.putpixel((0, 0), 255)
    assert np.array_equal(np.asarray(mask_from(openai_mask)), np.asarray(grey))
    out = fitted({"image": Image.new("RGB", (80, 48)), "mask_image": grey, "strength": 0.5}, (64, 32))
    assert out["image"].size == out["mask_image"].size == (64, 32) and out["strength"] == 0.5


def test_bcg_generate_image_to_image_and_inpainting(tmp_path: Path) -> None:
    red, blue = picture(tmp_path / "red.png", (200, 30, 30)), picture(tmp_path / "blue.png", (30, 30, 200))
    runs = {}
    for name, image in (("a", red), ("b", red), ("c", blue)):
        out = tmp_path / f"{name}.png"
        assert main(["--image", str(image), "--strength", "0.5", "--seed", "2", "--out", str(out), *FAST]) == 0
        runs[name] = out
    assert Image.open(runs["a"]).size == (80, 48)  # the input's size, a multiple of 16 already
    assert np.array_equal(pixels(runs["a"]), pixels(runs["b"])) and not np.array_equal(pixels(runs["a"]),
                                                                                          pixels(runs["c"]))  # fmt: skip
    text = read_image_text(runs["a"])
    assert text["input_image"] == "red.png (80x48), img2img, strength 0.5"
    assert "Denoising strength: 0.5" in text["parameters"]
    mask = tmp_path / "mask.png"
    Image.new("L", (80, 48), 255).save(mask)
    out = tmp_path / "inpainted.png"
    assert main(["--image", str(red), "--mask", str(mask), "--resolution", "64x64", "--out", str(out), *FAST]) == 0
    assert Image.open(out).size == (64, 64) and read_image_text(out)["input_image"].startswith(
        "red.png (80x48), inpaint"
    )


def test_an_edit_model_folder_takes_the_image_through_its_own_call(tmp_path: Path) -> None:
    """FLUX.1 Kontext (tiny, saved as a pipeline folder, as a user's download is): its own call
    takes the image; nothing names the model."""
    folder = tmp_path / "kontext"
    FluxKontextPipeline.from_pipe(build_pipeline("flux", "tiny")).save_pretrained(folder)
    red = picture(tmp_path / "red.png", (200, 30, 30))
    out = tmp_path / "edited.png"
    assert main(["--model", str(folder), "--image", str(red), "--resolution", "32x32", "--steps", "2",
                 "--strength", "0.5", "--out", str(out), "--quiet"]) == 0  # fmt: skip
    text = read_image_text(out)
    assert text["input_image"] == "red.png (80x48), edit" and Image.open(out).size == (32, 32)
