"""The pieces another front end reuses (CPU, the tiny models): the model flags on a parser of its
own, read back as bcg-generate reads them and without torch; the pipeline they make, checked
before it is built; and one call's PNGs in memory, byte for byte the file bcg-generate writes."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from pipelines.cli import main
from pipelines.cli.arguments import build_parser
from pipelines.cli.jobs import file_names, plan_jobs
from pipelines.generation import (
    InputError,
    ModelSettings,
    Workload,
    add_model_arguments,
    call_settings,
    encode_image,
    image_texts,
    load_pipeline,
    model_settings,
)
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.prompts import count_tokens

ROOT = Path(__file__).resolve().parents[3]
MODEL_FLAGS = ["--model", "qwen-image", "--mode", "debug", "--warmup", "64x64", "96x64", "64x64", "--cache", "fbc",
               "--cache-threshold", "0.2", "--no-vae-graphs", "--no-cfg-batch", "--device", "cpu", "--dtype", "bf16"]  # fmt: skip


def _server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="a-server")
    add_model_arguments(parser)
    parser.add_argument("--port", type=int, default=8000)
    return parser


def test_the_model_flags_read_the_same_on_another_parser() -> None:
    server = model_settings(_server_parser().parse_args([*MODEL_FLAGS, "--port", "9"]))
    cli = model_settings(build_parser().parse_args([*MODEL_FLAGS, "--prompt", "a fox"]))
    assert server == cli
    assert server.warmup == ((64, 64), (96, 64)) and server.cache is not None and server.cache.threshold == 0.2
    assert (server.mode, server.dtype_name("cpu"), server.accelerated) == ("debug", "bfloat16", True)
    assert server.accelerate_options() == {"vae": False, "cfg_batch": False}
    defaults = model_settings(_server_parser().parse_args([]))
    assert defaults == ModelSettings() and defaults.mode == "bcg" and defaults.dtype_name("cuda") == "bfloat16"
    assert (
        not ModelSettings(mode_flag="eager").accelerated
        and ModelSettings(mode_flag="eager", parallel="cfg").accelerated
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--compile", "--mode", "eager"], "--mode eager never does"),
        (["--warmup", "none", "64x64"], "resolutions or 'none', not both"),
        (["--cache-interval", "2"], "--cache-interval tune a step cache"),
    ],
)
def test_model_flags_that_do_not_fit_are_refused(argv: list[str], expected: str) -> None:
    with pytest.raises(InputError, match=expected):
        model_settings(_server_parser().parse_args(argv))


def test_the_model_flags_import_no_torch() -> None:
    code = """
        import argparse, sys
        from pipelines.generation import add_model_arguments, model_settings
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        settings = model_settings(parser.parse_args(["--cache", "fbc", "--warmup", "none"]))
        print(settings.warmup, settings.cache.method, [m for m in ("torch", "diffusers", "accel") if m in sys.modules])
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "() fbc []"


@pytest.mark.parametrize(
    "argv, workload, expected",
    [
        (["--size", "full", "--device", "cpu"], Workload([(64, 64)]), "--size full needs a CUDA GPU"),
        ([], Workload([(8208, 64)]), "--resolution 8208x64 is wider than 8192 pixels"),
        (["--warmup", "16x8208"], Workload([(64, 64)]), "--warmup 16x8208 is taller than 8192 pixels"),
        (["--device", "meta"], Workload([(64, 64)]), "--device meta holds shapes but no data"),
    ],
)
def test_load_pipeline_refuses_before_building(
    argv: list[str], workload: Workload, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    with pytest.raises(InputError, match=expected):
        load_pipeline(_server_parser().parse_args(argv), workload)


def test_load_pipeline_refuses_steps_the_scheduler_cannot_take() -> None:
    with pytest.raises(InputError, match="at least 2"):
        load_pipeline(_server_parser().parse_args(["--model", "qwen-image"]), Workload([(64, 64)], steps=1))


def test_one_calls_pngs_are_the_files_bcg_generate_writes(tmp_path: Path) -> None:
    """The server's path (load_pipeline, generate, image_texts, encode_image) against the CLI's, same flags."""
    prompt, flags = "a red fox", ["--model", "qwen-image", "--device", "cpu"]
    out = tmp_path / "out"
    argv = [*flags, "--prompt", prompt, "--seed", "5", "--batch-size", "2", "--steps", "2", "--resolution", "64x48"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    files = sorted(out.iterdir())

    prepared = load_pipeline(_server_parser().parse_args(flags), Workload([(64, 48)], batch_size=2, steps=2,
                                                                        prompts=[prompt]), progress=False)  # fmt: skip
    (job,) = plan_jobs([prompt], [(64, 48)], 2, 5)
    result = prepared.generate(job)
    texts = image_texts(job, prepared.text(), result.mode, prepared.settings.mode, count_tokens(prepared.pipe, prompt))
    pngs = [encode_image(image, text, "png") for image, text in zip(result.images, texts)]
    assert [f.name for f in files] == file_names(job)
    assert pngs == [f.read_bytes() for f in files]  # pixels and text, byte for byte
    with Image.open(io.BytesIO(pngs[1])) as image:
        image.load()
        text = dict(image.text)
    assert (image.size, text["seed"], text["index"], text["steps"], text["model"]) == ((64, 48), "6", "1", "2",
                                                                                      "qwen-image")  # fmt: skip
    assert text["guidance"] == "4" and text["negative_prompt"] == " "  # qwen-image's defaults, as the CLI has them

    # A call of other settings (a request naming its own steps) says so in its text.
    three = call_settings(prepared.pipe, "qwen-image", "tiny", steps=3, guidance=0.0)
    other = prepared.generate(job, call=three)
    text = image_texts(job, prepared.text(three), other.mode, prepared.settings.mode)[0]
    first = encode_image(other.images[0], text, "png")
    with Image.open(io.BytesIO(first)) as image:
        image.load()
        assert (image.text["steps"], image.text["guidance"], "prompt_tokens" in image.text) == ("3", "0", False)
        with Image.open(files[0]) as two_steps:
            assert image.tobytes() != two_steps.tobytes()
