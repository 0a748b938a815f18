"""Model flags that change the model before it is accelerated: ``--scheduler`` (a class the
model's scheduler lists as compatible, from its config) and ``--transformer FILE`` (a single-file
denoiser checkpoint through diffusers' ``from_single_file``, configured as the model's own); each
refusal one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.generation.formats import read_image_text

FAST = ["--resolution", "32x32", "--steps", "2", "--seed", "4", "--quiet"]


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im, dtype=np.int16)


def test_a_compatible_scheduler_is_used_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    default, heun = tmp_path / "default.png", tmp_path / "heun.png"
    assert main([*FAST, "--out", str(default)]) == 0
    assert main([*FAST, "--scheduler", "FlowMatchLCMScheduler", "--out", str(heun)]) == 0
    assert read_image_text(default)["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    assert read_image_text(heun)["scheduler"] == "FlowMatchLCMScheduler"
    assert "Sampler: FlowMatchLCMScheduler" in read_image_text(heun)["parameters"]
    assert not np.array_equal(pixels(default), pixels(heun))
    capsys.readouterr()
    assert main([*FAST, "--scheduler", "DDIMScheduler", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "--scheduler DDIMScheduler: ZImagePipeline's FlowMatchEulerDiscreteScheduler lists as compatible" in err
    assert "FlowMatchLCMScheduler" in err and err.count("\n") == 1


def test_a_single_file_denoiser_replaces_the_models_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fine-tune as one .safetensors file: another seed's weights give other pixels, and the
    same weights as the built model's give its pixels exactly."""
    same, other = tmp_path / "same.safetensors", tmp_path / "other.safetensors"
    save_file(build_pipeline("z-image", "tiny", seed=0).transformer.state_dict(), str(same))
    save_file({k: v.contiguous() for k, v in build_pipeline("z-image", "tiny", seed=5).transformer.state_dict().items()},
              str(other))  # fmt: skip
    runs = {}
    for name, extra in (
        ("stock", []),
        ("same", ["--transformer", str(same)]),
        ("other", ["--transformer", str(other)]),
    ):
        runs[name] = tmp_path / f"{name}.png"
        assert main([*FAST, *extra, "--out", str(runs[name])]) == 0
    assert np.array_equal(pixels(runs["stock"]), pixels(runs["same"]))
    assert not np.array_equal(pixels(runs["stock"]), pixels(runs["other"]))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"not.a.layer": torch.zeros(2)}, str(wrong))
    capsys.readouterr()
    assert main([*FAST, "--transformer", str(wrong), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "--transformer wrong.safetensors: not a ZImageTransformer2DModel checkpoint" in err and err.count("\n") == 1
