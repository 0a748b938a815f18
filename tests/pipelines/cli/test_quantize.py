"""bcg-generate --quantize (CPU, the tiny models): refused in one line before anything is built
where it cannot run, passed to accelerate_pipeline where it can, and recorded in the PNG text as
what ran (the float8 quantizer is a stand-in here: tests/helpers/fake_quant.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.record import quantized
from tests.helpers.fake_quant import use_grid

FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bcg-generate: error: ") and "Traceback" not in err, err
    return lines[0]


BAD = [
    ("unknown value", ["--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
    (
        "eager mode",
        ["--quantize", "fp8", "--mode", "eager"],
        "--quantize fp8 is applied by the accelerator, which --mode eager skips: drop one of them",
    ),
    ("parallel", ["--quantize", "fp8", "--parallel", "cfg"], "--quantize fp8 does not combine with --parallel yet"),
    (
        "no warm-up",
        ["--quantize", "fp8", "--warmup", "none"],
        "--quantize fp8 measures its layers in the warm-up: drop --warmup none",
    ),
]
if not torch.cuda.is_available():
    BAD.append(
        (
            "the cpu",
            ["--quantize", "fp8"],
            "--quantize fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            "the denoiser is on cpu",
        )
    )


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_quantize_that_cannot_run_is_one_line_before_building(case, tmp_path: Path, capsys, monkeypatch) -> None:
    _, argv, expected = case

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    assert main([*argv, *FAST, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_dtype_other_than_bf16_is_refused_before_building(tmp_path: Path, capsys, monkeypatch) -> None:
    import accel

    monkeypatch.setattr(accel, "check_quantize", lambda value, device: None)  # as on a GPU that runs float8
    monkeypatch.setattr(generation_prepare, "build_model", lambda *a, **k: pytest.fail("built"))
    assert main(["--quantize", "fp8", "--dtype", "float32", *FAST, "--out", str(tmp_path / "out")]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        "--quantize fp8 makes its float8 weights from bfloat16 ones: use --dtype bfloat16, not float32"
    )


def test_quantize_reaches_accelerate_pipeline_and_the_png_says_what_ran(tmp_path: Path, monkeypatch) -> None:
    import accel

    use_grid(monkeypatch)
    monkeypatch.setattr(accel, "check_quantize", lambda value, device: None)
    seen: list[dict[str, Any]] = []
    original = accel.accelerate_pipeline

    def record(pipe: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(pipe, **kwargs)

    monkeypatch.setattr(accel, "accelerate_pipeline", record)
    out = tmp_path / "q.png"
    assert main(["--quantize", "fp8", "--dtype", "bfloat16", *FAST, "--out", str(out)]) == 0
    assert seen == [{"mode": "bcg", "quantize": "fp8"}]
    with Image.open(out) as im:
        im.load()
        # On the CPU nothing is warmed up, so nothing was quantized: the image says so.
        assert im.text["quantize"] == "fp8 requested, not applied yet (no warm-up): bf16"


def test_the_png_text_of_a_quantized_pipeline_is_its_summary(monkeypatch) -> None:
    use_grid(monkeypatch, levels=64)
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    assert quantized(pipe) is None
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=0.5)
    pipe.accel.warmup((64, 64), progress=False)
    text = quantized(pipe)
    assert text == pipe.accel.quantization.summary()
    assert text.startswith("fp8 (stand-in grid): ") and " Linear layers in float8, " in text
