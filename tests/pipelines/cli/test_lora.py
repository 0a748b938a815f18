"""bcg-generate --lora on the tiny Z-Image and Qwen-Image models (CPU): the image equals a stock
pipeline that loaded the same LoRA with diffusers, its PNG text records the files and scales, the
adapters are in place before the accelerator sees the denoiser, and a LoRA the model cannot take
is one line, exit 2, after the build but before anything is generated or written. (The bad inputs
refused before the build are in test_run.py's BEFORE_BUILD.)"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.cli.jobs import plan_jobs
from pipelines.generation import Workload, add_model_arguments, call_settings, load_pipeline, model_settings
from pipelines.generation import calls as generation_calls
from pipelines.generation import prepare as generation_prepare
from pipelines.lora import LoraSpec, activate
from tests.helpers.lora_files import make_lora_file

FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _text(path: Path) -> dict[str, str]:
    with Image.open(path) as im:
        im.load()
        return dict(im.text)


def _stock(model: str, loras: list[tuple[Path, float]], seed: int) -> np.ndarray:
    """The image of a stock pipeline that loaded ``loras`` with diffusers, called as the CLI calls it."""
    pipe = build_pipeline(model, "tiny")
    pipe.set_progress_bar_config(disable=True)
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"stock{i}")
    if loras:
        pipe.set_adapters([f"stock{i}" for i in range(len(loras))], [scale for _, scale in loras])
    (job,) = plan_jobs(["a fox"], [(64, 64)], 1, seed)
    kwargs = call_settings(pipe, model, "tiny", steps=2).kwargs(job, torch.device("cpu"))
    output = pipe(**{**kwargs, "output_type": "np"})  # diffusers' own conversion, the CLI's reference
    return np.asarray(pipe.image_processor.numpy_to_pil(output.images)[0].convert("RGB"))


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # the stock pipeline's second adapter
@pytest.mark.parametrize("model", ["z-image", "qwen-image"])
def test_the_image_with_a_lora_equals_a_stock_pipeline_that_loaded_it(model: str, tmp_path: Path) -> None:
    a = make_lora_file(model, tmp_path / "loras" / "style.safetensors", seed=1)
    b = make_lora_file(model, tmp_path / "loras" / "detail.safetensors", seed=2, alpha=4)
    with_lora, without = tmp_path / "with.png", tmp_path / "without.png"
    argv = ["--model", model, "--prompt", "a fox", "--seed", "5", *FAST]
    assert main([*argv, "--lora", f"{a}:0.7", "--lora", str(b), "--out", str(with_lora)]) == 0
    assert main([*argv, "--out", str(without)]) == 0

    assert np.array_equal(_pixels(with_lora), _stock(model, [(a, 0.7), (b, 1.0)], seed=5))
    assert not np.array_equal(_pixels(with_lora), _pixels(without))  # the adapters change the image
    assert _text(with_lora)["lora"] == "style.safetensors:0.7, detail.safetensors:1"  # names, not folders
    assert "lora" not in _text(without)


def test_adapters_are_loaded_before_the_step_cache_and_the_accelerator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lora = make_lora_file("qwen-image", tmp_path / "a.safetensors")
    seen: dict[str, Any] = {}
    real_cache, real_accelerate = generation_prepare.apply_cache, generation_prepare._accelerate

    def cache(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        seen["cache"] = pipe.get_active_adapters()
        return real_cache(pipe, *args, **kwargs)

    def accelerate(pipe: Any, *args: Any, **kwargs: Any) -> None:
        seen["accelerate"] = pipe.get_active_adapters()
        real_accelerate(pipe, *args, **kwargs)

    monkeypatch.setattr(generation_prepare, "apply_cache", cache)
    monkeypatch.setattr(generation_prepare, "_accelerate", accelerate)
    out = tmp_path / "a.png"
    assert main(["--model", "qwen-image", "--cache", "fbc", "--lora", str(lora), "--out", str(out), *FAST]) == 0
    assert seen == {"cache": ["a"], "accelerate": ["a"]}
    assert _text(out)["lora"] == "a.safetensors:1"


def _another_models(tmp_path: Path) -> dict[str, Path]:
    q = make_lora_file("qwen-image", tmp_path / "qwen.safetensors")
    z = load_file(str(make_lora_file("z-image", tmp_path / "z.safetensors")))
    bigger = tmp_path / "bigger.safetensors"
    save_file({k: torch.randn(v.shape[0] + 1, v.shape[1]) for k, v in z.items()}, str(bigger))
    return {"qwen": q, "bigger": bigger}


@pytest.mark.parametrize(
    "which, says",
    [
        (
            "qwen",
            "--lora '{tmp}/qwen.safetensors' is a LoRA for another model: none of the 6 modules it adapts "
            "(e.g. transformer_blocks.0.attn.to_k) is in ZImageTransformer2DModel",
        ),
        ("bigger", "--lora '{tmp}/bigger.safetensors' does not fit ZImageTransformer2DModel's shapes"),
    ],
)
def test_a_lora_for_another_model_is_one_line_after_the_build_before_any_image(
    which: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _another_models(tmp_path)
    built: list[bool] = []
    real_build = generation_prepare.build_model

    def build(*args: Any, **kwargs: Any) -> Any:
        built.append(True)
        return real_build(*args, **kwargs)

    def no_generation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a LoRA the model cannot take must be refused before anything is generated")

    monkeypatch.setattr(generation_prepare, "build_model", build)
    monkeypatch.setattr(generation_prepare, "generate_frames", no_generation)
    monkeypatch.setattr(generation_calls, "generate_frames", no_generation)
    out = tmp_path / "out"
    rc = main(["--lora", str(tmp_path / "z.safetensors"), "--lora", str(files[which]), "--out", str(out), *FAST])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and built == [True]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("bcg-generate: error: " + says.replace("{tmp}", str(tmp_path))), lines[0]
    assert not out.exists()


def test_a_server_loads_named_adapters_through_the_model_flags(tmp_path: Path) -> None:
    """Another front end's parser takes the same --lora, NAME=FILE[:SCALE] included; the prepared
    pipeline holds the adapters by name, all active, and activate() picks among them."""
    ink = make_lora_file("z-image", tmp_path / "ink.safetensors", seed=1)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--lora", f"ink={ink}:0.5", "--lora", str(ink)])
    settings = model_settings(args)
    assert settings.loras == (LoraSpec(ink, 0.5, "ink"), LoraSpec(ink, 1.0))
    prepared = load_pipeline(settings, Workload(resolutions=[(64, 64)]), progress=False)
    assert prepared.loras == (LoraSpec(ink, 0.5, "ink"), LoraSpec(ink, 1.0, "ink-2"))
    assert prepared.pipe.get_active_adapters() == ["ink", "ink-2"]
    assert prepared.text()["lora"] == "ink.safetensors:0.5, ink.safetensors:1"
    activate(prepared.pipe, prepared.loras[:1])
    assert prepared.pipe.get_active_adapters() == ["ink"]


@pytest.mark.parametrize("scale, warned", [("10", False), ("-10", False), ("10.5", True), ("-1e9", True)])
def test_a_scale_far_outside_the_usual_range_is_one_warning_before_the_build(
    scale: str, warned: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale of 1e9 was taken without a word. It is allowed (a finite number), but more likely a
    typo: one line, said before the build (which may take minutes), in both tools' prepare_pipeline."""
    lora = make_lora_file("z-image", tmp_path / "style.safetensors")

    def stop(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(generation_prepare, "build_model", stop)
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--lora", f"{lora}:{scale}", "--out", str(tmp_path / "o"), *FAST]) == 130
    said = [r.getMessage() for r in caplog.records if "--lora" in r.getMessage()]
    expected = f"--lora style.safetensors: a scale of {float(scale):g} is far outside the usual range (-10 to 10)"
    assert [m.startswith(expected) for m in said] == ([True] if warned else []), said
