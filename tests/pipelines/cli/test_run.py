"""The bcg-generate CLI end to end on the tiny built-in model (CPU); bad input and failures, each
one line with the right exit status and nothing written (most refused before a model is built);
the limits of pipelines.limits; and the split of work across processes (pure functions, then a
real two-process accelerate launch)."""

from __future__ import annotations

import errno
import inspect
import logging
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from accel.hooks.options import default_compile_cache_dir
from pipelines import limits
from pipelines.cli import main
from pipelines.cli.arguments import build_parser
from pipelines.cli.jobs import file_names, plan_jobs, read_prompts_file, shard, slug
from pipelines.generation import DEFAULT_PROMPT, Job
from pipelines.generation import calls as generation_calls
from pipelines.generation import loading as generation_loading
from pipelines.generation import prepare as generation_prepare
from tests.helpers.ranks import free_port

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = not torch.cuda.is_available()
FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]


def png_text(path: Path) -> dict[str, str]:
    with Image.open(path) as im:
        im.load()
        return dict(im.text)


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        return im.size


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------
def test_single_image_with_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fox.png"
    rc = main(["--prompt", "a red fox", "--seed", "7", "--out", str(out), *FAST])
    assert rc == 0
    assert png_size(out) == (64, 64)
    meta = png_text(out)
    assert meta["prompt"] == "a red fox"
    assert meta["seed"] == "7"
    assert meta["steps"] == "2"
    assert meta["resolution"] == "64x64"
    # What ran: without CUDA no graph is captured, so the denoiser ran eagerly, whatever was asked.
    assert (meta["mode"], meta.get("requested_mode")) == (("eager", "bcg") if NO_CUDA else ("bcg", None))
    assert meta["prompt_tokens"].isdigit() and int(meta["prompt_tokens"]) > 3
    assert meta["model"] == "z-image"
    assert meta["guidance"] == "0"
    assert meta["Software"].startswith("bcg-diffusers ")
    summary = capsys.readouterr().out
    assert "s/image" in summary and "denoising steps/s" in summary and "graph memory" in summary
    assert summary.rstrip().endswith(f"wrote {out}")  # where the image went
    if NO_CUDA:
        assert "mode eager (--mode bcg asked, no CUDA device)" in summary


@pytest.mark.skipif(not NO_CUDA, reason="what a machine without CUDA runs")
def test_the_report_and_the_summary_agree_on_what_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "r.png"), "--report", *FAST]) == 0
    summary, head = capsys.readouterr().out.splitlines()[:2]
    assert "mode eager (--mode bcg asked, no CUDA device)" in summary
    assert (
        head == "bcg-diffusers: ZImagePipeline, mode bcg asked, eager here: CUDA is not available (graphs need a "
        "CUDA device)"
    )


def test_same_seed_same_pixels_and_eager_mode(tmp_path: Path) -> None:
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    assert main(["--prompt", "a cat", "--seed", "3", "--out", str(a), *FAST]) == 0
    assert main(["--prompt", "a cat", "--seed", "3", "--mode", "eager", "--out", str(b), *FAST]) == 0
    with Image.open(a) as ia, Image.open(b) as ib:
        assert ia.tobytes() == ib.tobytes()
    assert png_text(b)["mode"] == "eager"


def test_batch_and_two_resolutions(tmp_path: Path) -> None:
    rc = main(["--prompt", "A Blue Bird!", "--resolution", "64x64", "96x64", "--steps", "2",
               "--batch-size", "2", "--seed", "10", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert rc == 0
    expected = {
        "0000-a-blue-bird-64x64-s10.png": (64, 64),
        "0001-a-blue-bird-64x64-s11.png": (64, 64),
        "0002-a-blue-bird-96x64-s12.png": (96, 64),
        "0003-a-blue-bird-96x64-s13.png": (96, 64),
    }
    assert {p.name for p in tmp_path.iterdir()} == set(expected)
    for name, size in expected.items():
        assert png_size(tmp_path / name) == size
        meta = png_text(tmp_path / name)
        assert meta["seed"] == name.split("-s")[-1].removesuffix(".png")
        assert meta["resolution"] == f"{size[0]}x{size[1]}"


def test_width_height_num_images_and_a_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    rc = main(["--prompt", "a fox", "--width", "48", "--height", "32", "--num-images", "3", "--batch-size", "2",
               "--steps", "2", "--seed", "5", "--out", str(tmp_path), "--json", "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)  # stdout holds the JSON alone
    assert "3 image(s) in" in out.err  # the summary line went to stderr
    assert (summary["made"], summary["calls"], summary["steps"], summary["model"]) == (3, 2, 2, "z-image")
    assert [(f["seed"], f["width"], f["height"], f["index"]) for f in summary["files"]] == [
        (5, 48, 32, 0), (6, 48, 32, 1), (7, 48, 32, 2)]  # fmt: skip
    for f in summary["files"]:
        assert png_size(Path(f["file"])) == (48, 32) and png_text(Path(f["file"]))["seed"] == str(f["seed"])
    params = png_text(Path(summary["files"][0]["file"]))["parameters"]
    assert params.startswith("a fox\nSteps: 2, Sampler: FlowMatchEulerDiscreteScheduler, CFG scale: 0, Seed: 5, ")
    assert "Size: 48x32, Model: z-image, Version: bcg-diffusers " in params


def test_repeated_resolution_flag(tmp_path: Path) -> None:
    rc = main(["--resolution", "64x64", "--resolution", "64x96", "--steps", "2", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    assert sorted(png_size(p) for p in tmp_path.iterdir()) == [(64, 64), (64, 96)]


def test_prompts_file(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# a comment\na lighthouse at night\n\n   \nsnowy mountains\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["--prompts-file", str(prompts), "--out", str(out), *FAST]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["0000-a-lighthouse-at-night-64x64-s0.png", "0001-snowy-mountains-64x64-s1.png"]
    assert png_text(out / names[1])["prompt"] == "snowy mountains"


def test_bare_command_uses_the_default_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # The real bare command (512x512, 9 steps) runs; only --quiet keeps the test log short.
    assert main(["--quiet"]) == 0
    (image,) = (tmp_path / "outputs").iterdir()
    assert image.name == f"0000-{slug(DEFAULT_PROMPT)}-512x512-s0.png"
    assert png_size(image) == (512, 512)
    assert png_text(image)["prompt"] == DEFAULT_PROMPT
    assert png_text(image)["steps"] == "9"


def test_qwen_image_defaults(tmp_path: Path) -> None:
    out = tmp_path / "q.png"
    assert main(["--model", "qwen-image", "--prompt", "a fox", "--out", str(out), *FAST]) == 0
    meta = png_text(out)
    assert png_size(out) == (64, 64)
    assert meta["model"] == "qwen-image"
    assert meta["guidance"] == "4"  # true CFG on, so the default negative prompt is used
    assert meta["negative_prompt"] == " "


# --------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2 (1 for failures while loading or generating), no
# traceback, nothing written
# --------------------------------------------------------------------------------------------
# (name, arguments, what the line must say, exit status). "{tmp}" is the test's folder, in which
# "a-file" exists and "out" is where output would go. All of these are refused before a model is
# built (the test makes building fail loudly).
BEFORE_BUILD: list[tuple[str, list[str], str, int]] = [
    ("resolution without x", ["--resolution", "512"], "is not WIDTHxHEIGHT", 2),
    ("resolution not numbers", ["--resolution", "axb"], "is not WIDTHxHEIGHT", 2),
    ("zero width", ["--resolution", "0x512"], "positive multiples of 16", 2),
    ("not a multiple of 16", ["--resolution", "500x512"], "positive multiples of 16", 2),
    ("negative resolution", ["--resolution", "-5x5"], "resolution '-5x5': width and height must be positive", 2),
    ("negative among several", ["--resolution", "64x64", "-16x16"], "resolution '-16x16'", 2),
    ("beyond z-image positions", ["--resolution", "100000x100000"], "larger than 8192x8192", 2),
    (
        "beyond qwen-image positions",
        ["--model", "qwen-image", "--resolution", "100000x100000"],
        "larger than 98320x98320",
        2,
    ),
    ("warmup beyond positions", ["--warmup", "8208x64"], "--warmup 8208x64 is wider than 8192 pixels", 2),
    ("wider, not larger", ["--resolution", "8208x16"], "--resolution 8208x16 is wider than 8192 pixels, the widest", 2),
    ("taller, not larger", ["--resolution", "16x8208"], "is taller than 8192 pixels, the tallest", 2),
    ("batch beyond host memory", ["--batch-size", str(10**12)], "of host memory", 2),
    ("too many steps", ["--steps", "100000"], "1 to 1000", 2),
    ("zero steps", ["--steps", "0"], "1 to 1000", 2),
    ("steps not a number", ["--steps", "many"], "'many' is not an integer", 2),
    ("guidance nan", ["--guidance", "nan"], "a number from 0 to 100", 2),
    ("guidance inf", ["--guidance", "inf"], "a number from 0 to 100", 2),
    ("guidance -inf", ["--guidance", "-inf"], "a number from 0 to 100", 2),
    ("negative guidance", ["--guidance", "-1"], "a number from 0 to 100", 2),
    ("absurd guidance", ["--guidance", "1e308"], "a number from 0 to 100", 2),
    ("guidance not a number", ["--guidance", "lots"], "'lots' is not a number", 2),
    ("seed beyond 64 bits", ["--seed", "99999999999999999999"], "outside 0 to 2**63 - 1", 2),
    ("negative seed", ["--seed", "-1"], "outside 0 to 2**63 - 1", 2),
    (
        "last seed overflows",
        ["--seed", str(2**63 - 1), "--batch-size", "2"],
        "the first seed must be between 0 and 9223372036854775806",
        2,
    ),
    ("empty prompt", ["--prompt", ""], "a prompt cannot be empty", 2),
    ("blank prompt among others", ["--prompt", "a fox", "--prompt", "   "], "a prompt cannot be empty", 2),
    ("bmp out", ["--out", "{tmp}/fox.bmp"], "images are written as PNG, JPEG or WebP; use '{tmp}/fox.png'", 2),
    ("gif out for images", ["--out", "{tmp}/fox.GIF"], "images are written as PNG, JPEG or WebP (.gif is for", 2),
    ("format against the out file", ["--format", "jpeg", "--out", "{tmp}/fox.webp"], "disagree: drop one", 2),
    ("quality for png", ["--quality", "80"], "--quality sets JPEG's and lossy WebP's quality; PNG is lossless", 2),
    ("quality out of range", ["--format", "jpeg", "--quality", "0"], "--quality: must be 1 to 100, got 0", 2),
    ("format for videos", ["--model", "wan", "--format", "jpeg"], "--format jpeg sets image files' format", 2),
    ("width and resolution", ["--width", "64", "--resolution", "64x64"], "both set the size: use one", 2),
    ("width off the multiple", ["--width", "60"], "--width: 60 is not a multiple of 16", 2),
    ("mask without image", ["--mask", "{tmp}/a-file"], "--mask goes with an input image: add --image FILE", 2),
    ("strength without image", ["--strength", "0.5"], "--strength goes with an input image", 2),
    ("strength above 1", ["--image", "{tmp}/a-file", "--strength", "1.5"], "must be above 0 and at most 1", 2),
    ("image not an image", ["--image", "{tmp}/a-file"], "--image '{tmp}/a-file' is not an image Pillow can read", 2),
    ("image missing", ["--image", "{tmp}/none.png"], "--image '{tmp}/none.png' does not exist", 2),
    ("image for a video model", ["--model", "wan", "--image", "{tmp}/a-file"], "this model makes videos from text", 2),
    ("size for a folder", ["--model", "{tmp}/not-a-pipeline", "--size", "full"], "--size full sizes the built-in", 2),
    ("weights file as model", ["--model", "{tmp}/fine-tune.safetensors"], "is a file of weights, not a pipeline", 2),
    ("transformer not safetensors", ["--transformer", "{tmp}/lora.bin"], "is not a .safetensors file", 2),
    ("scheduler not a name", ["--scheduler", "flow match"], "is not a scheduler class name", 2),
    ("num images zero", ["--num-images", "0"], "--num-images: must be at least 1", 2),
    ("existing file as out", ["--out", "{tmp}/a-file"], "is an existing file, not a folder", 2),
    ("empty out", ["--out", ""], "--out: is empty", 2),
    ("out to stdout", ["--out", "-"], "'-': images are not written to stdout; name a .png file or a folder", 2),
    ("out in an unknown user's home", ["--out", "~no-such-user-bcg/x.png"], "is no user's home folder here", 2),
    ("unwritable out", ["--out", "{tmp}/a-file/sub"], "is not writable", 2),
    ("several images into one png", ["--batch-size", "2", "--out", "{tmp}/one.png"], "names one file", 2),
    ("missing prompts file", ["--prompts-file", "{tmp}/missing.txt"], "does not exist", 2),
    ("prompts file from stdin", ["--prompts-file", "-"], "prompts are not read from stdin", 2),
    ("prompts file is a folder", ["--prompts-file", "{tmp}"], "is a folder, not a text file", 2),
    ("prompts file not utf-8", ["--prompts-file", "{tmp}/latin1.txt"], "is not UTF-8 text", 2),
    ("prompts file only comments", ["--prompts-file", "{tmp}/comments.txt"], "holds no prompts", 2),
    ("unknown device", ["--device", "quantum-computer"], "not a device torch knows", 2),
    ("meta device", ["--device", "meta"], "--device meta holds shapes but no data", 2),
    ("unknown mode", ["--mode", "turbo"], "invalid choice: 'turbo'", 2),
    ("unknown dtype", ["--dtype", "int8"], "invalid choice: 'int8'", 2),
    ("warmup none and sizes", ["--warmup", "none", "64x64"], "resolutions or 'none', not both", 2),
    ("compile in eager mode", ["--compile", "--mode", "eager"], "--mode eager never does", 2),
    ("compile cache without compile", ["--compile-cache", "{tmp}/cache"], "add --compile", 2),
    ("compile cache is a file", ["--compile", "--compile-cache", "{tmp}/a-file"], "is an existing file", 2),
    ("model folder missing", ["--model", "{tmp}/no-such-folder"], "no such folder", 2),
    ("model is a file", ["--model", "{tmp}/a-file"], "is a file; a local model is a diffusers pipeline folder", 2),
    ("model folder not a pipeline", ["--model", "{tmp}/not-a-pipeline"], "holds no model_index.json", 2),
    ("empty model", ["--model", " "], "--model: is empty", 2),
    (
        "prompt not utf-8",
        ["--prompt", "\udced\udca0\udc80 fox"],
        "is not valid UTF-8 text (the byte 0xed at character 0)",
        2,
    ),
    ("negative prompt not utf-8", ["--negative-prompt", "bad \udcff"], "--negative-prompt: is not valid UTF-8 text", 2),
    ("prompts file with NUL bytes", ["--prompts-file", "{tmp}/utf16.txt"], "line 1 holds a NUL byte (UTF-16 text?", 2),
    ("threshold without cache", ["--cache-threshold", "0.1"], "--cache-threshold tune a step cache", 2),
    (
        "interval and ratios without cache",
        ["--cache-interval", "2", "--cache-ratios", "1"],
        "--cache-interval and --cache-ratios tune a step cache",
        2,
    ),
    ("interval for fbc", ["--cache", "fbc", "--cache-interval", "2"], "--cache fbc takes no --cache-interval", 2),
    (
        "threshold for taylorseer",
        ["--cache", "taylorseer", "--cache-threshold", "0.1"],
        "--cache taylorseer takes no --cache-threshold (its knob: --cache-interval)",
        2,
    ),
    (
        "ratios for dbcache",
        ["--cache", "dbcache", "--cache-ratios", "1,1"],
        "--cache dbcache takes no --cache-ratios",
        2,
    ),
    ("magcache without ratios", ["--cache", "magcache"], "--cache magcache needs --cache-ratios", 2),
    ("threshold nan", ["--cache", "fbc", "--cache-threshold", "nan"], "'nan' is not a finite number", 2),
    ("threshold inf", ["--cache", "fbc", "--cache-threshold", "inf"], "'inf' is not a finite number", 2),
    ("threshold zero", ["--cache", "fbc", "--cache-threshold", "0"], "'0': must be a finite number above 0", 2),
    ("threshold negative", ["--cache", "fbc", "--cache-threshold", "-0.1"], "must be a finite number above 0", 2),
    ("threshold not a number", ["--cache", "fbc", "--cache-threshold", "high"], "'high' is not a number", 2),
    ("interval zero", ["--cache", "taylorseer", "--cache-interval", "0"], "must be at least 1, got 0", 2),
    ("interval not an integer", ["--cache", "taylorseer", "--cache-interval", "2.5"], "'2.5' is not an integer", 2),
    ("ratio not a number", ["--cache", "magcache", "--cache-ratios", "1.0,x"], "each ratio must be a finite number", 2),
    ("ratio zero", ["--cache", "magcache", "--cache-ratios", "1.0,0"], "each ratio must be a finite number above 0", 2),
    ("ratios empty", ["--cache", "magcache", "--cache-ratios", " , "], "--cache-ratios: is empty", 2),
    ("unknown cache", ["--cache", "teacache"], "invalid choice: 'teacache'", 2),
    ("lora missing", ["--lora", "{tmp}/missing.safetensors"], "--lora '{tmp}/missing.safetensors' does not exist", 2),
    ("lora is a folder", ["--lora", "{tmp}"], "--lora '{tmp}' is a folder; a LoRA is one .safetensors file", 2),
    ("lora not safetensors", ["--lora", "{tmp}/a-file"], "--lora '{tmp}/a-file' is not a safetensors file", 2),
    ("lora pickled", ["--lora", "{tmp}/lora.bin"], "is a pickled checkpoint; only .safetensors files", 2),
    (
        "lora scale nan",
        ["--lora", "{tmp}/a-file:nan"],
        "argument --lora: '{tmp}/a-file:nan': the scale 'nan' is not a finite number",
        2,
    ),
    ("lora scale inf", ["--lora", "{tmp}/a-file:-inf"], "the scale '-inf' is not a finite number", 2),
    ("lora scale not a number", ["--lora", "{tmp}/a-file:strong"], "the scale 'strong' is not a number", 2),
    ("lora without a file", ["--lora", ":0.5"], "names no file", 2),
    ("short option that is not one", ["-x"], "unrecognized arguments: -x", 2),
]
if Path("/proc/self").is_dir():  # permission bits say root may write there; the file system says no
    BEFORE_BUILD += [
        ("out under /proc", ["--out", "/proc/x.png"], "is not writable: cannot create files in '/proc'", 2)
    ]
if NO_CUDA:
    BEFORE_BUILD += [
        ("full size on cpu", ["--size", "full"], "--size full needs a CUDA GPU", 2),
        ("bcg on cuda without cuda", ["--mode", "bcg", "--device", "cuda"], "no CUDA device is available", 2),
        ("debug on cuda without cuda", ["--mode", "debug", "--device", "cuda"], "no CUDA device is available", 2),
    ]


def _bad_input_folder(tmp: Path) -> None:
    (tmp / "a-file").write_text("x")
    (tmp / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp / "comments.txt").write_text("# only\n\n   \n# comments\n", encoding="utf-8")
    (tmp / "utf16.txt").write_bytes("a fox\n".encode("utf-16-le"))  # no byte-order mark: decodes as UTF-8
    (tmp / "not-a-pipeline").mkdir()
    (tmp / "taken.png").write_bytes(b"an image made earlier")
    (tmp / "lora.bin").write_bytes(b"a pickled checkpoint")
    (tmp / "taken").mkdir()
    for seed in (0, 2):
        (tmp / "taken" / f"000{seed}-a-red-fox-in-the-snow-golden-hour-64x64-s{seed}.png").write_bytes(b"earlier")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("bcg-generate: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _run_bad(tmp: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    base = ["--quiet"]
    for option, value in (("--steps", "2"), ("--out", str(tmp / "out")), ("--resolution", "64x64")):
        if option not in argv:
            base += [option, value]
    # The case first: a value-like "-x" after --resolution's values would be read as one of them.
    rc = main([*argv, *base])
    line = _one_error_line(capsys.readouterr().err)
    assert not (tmp / "out").exists()  # nothing written, not even an empty folder
    return rc, line


@pytest.mark.parametrize("case", BEFORE_BUILD, ids=[c[0] for c in BEFORE_BUILD])
def test_bad_input_is_one_line_before_building(
    case: tuple[str, list[str], str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    _, argv, expected, status = case
    _bad_input_folder(tmp_path)

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    before = sorted(tmp_path.rglob("*"))
    rc, line = _run_bad(tmp_path, [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert expected.replace("{tmp}", str(tmp_path)) in line
    assert rc == status
    assert sorted(tmp_path.rglob("*")) == before  # no folder named fox.jpg, no empty out/
    assert (tmp_path / "taken.png").read_bytes() == b"an image made earlier"


def test_unknown_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, line = _run_bad(tmp_path, ["--model", "no-such-model"], capsys)
    assert rc == 2
    assert "unknown model 'no-such-model'" in line
    from pipelines.families import catalog

    assert all(f"'{name}'" in line for name in catalog.MODEL_NAMES)  # every built-in model is named


def test_unreachable_hub_model_is_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No hub warnings before it, and the cause rather than diffusers' 470-character story
    (offline here and in CI; with a network the name does not exist on the hub)."""
    rc, line = _run_bad(tmp_path, ["--model", "bcg-diffusers-tests/no-such-model"], capsys)
    assert rc == 1
    assert line.startswith("bcg-generate: error: could not load model 'bcg-diffusers-tests/no-such-model': ")
    assert len(line) < 200, line
    assert "Couldn't connect" not in line


class _FakeHubError(Exception):
    pass


@pytest.mark.parametrize(
    "cause,env,expected",
    [
        ("OfflineModeIsEnabled", "", "not found in the local cache, and HF_HUB_OFFLINE is set"),
        ("LocalEntryNotFoundError", "1", "not found in the local cache, and HF_HUB_OFFLINE is set"),
        ("ConnectError", "", "not found in the local cache, and the hub is unreachable"),
        ("RepositoryNotFoundError", "", "no such model on the hub"),
        ("GatedRepoError", "", "the repository is gated"),
    ],
)
def test_load_errors_name_their_cause(cause: str, env: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", env)
    root = type(cause, (_FakeHubError,), {})("details nobody needs")
    try:
        try:
            raise root
        except _FakeHubError as e:
            raise OSError("Cannot load model org/name: the model is not fully cached locally (...)") from e
    except OSError as e:
        message = generation_loading._load_error_message("org/name", e)
    assert message == f"could not load model 'org/name': {message.split(': ', 1)[1]}"
    assert expected in message


def test_qwen_image_needs_two_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, line = _run_bad(tmp_path, ["--model", "qwen-image", "--steps", "1"], capsys)
    assert rc == 2
    assert "needs at least 2 steps" in line and "shift_terminal" in line


def test_memory_limit_names_the_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "available_memory", lambda device: 2**20)
    rc, line = _run_bad(tmp_path, ["--resolution", "512x512"], capsys)
    assert rc == 2
    assert "512x512 with --batch-size 1 needs about" in line
    assert "VAE decode" in line and "1.0 MiB is free" in line


def test_non_finite_pixels_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decode that made NaN (guidance far too large did, before --guidance had a ceiling): once a
    # black PNG and exit 0.
    from diffusers import AutoencoderKL

    decode = AutoencoderKL.decode

    def nan_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = decode(self, *args, **kwargs)
        (out[0] if isinstance(out, tuple) else out.sample).fill_(float("nan"))
        return out

    monkeypatch.setattr(AutoencoderKL, "decode", nan_decode)
    rc, line = _run_bad(tmp_path, ["--guidance", "50"], capsys)
    assert rc == 1
    assert "NaN or infinite pixels" in line and "--guidance 50 may be too large" in line


def _fail_while_writing(error: BaseException) -> Any:
    """A ``Path.write_bytes`` that, for an image's hidden part file, writes half an image and
    raises ``error``; any other file is written."""
    write_bytes = Path.write_bytes

    def write(self: Path, data: Any) -> int:
        if ".part" not in self.name:
            return write_bytes(self, data)
        write_bytes(self, b"\x89PNG half an image")
        raise error

    return write


def test_full_disk_is_one_line_and_leaves_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Path, "write_bytes", _fail_while_writing(OSError(errno.ENOSPC, "No space left on device")))
    out = tmp_path / "out"
    rc = main(["--prompt", "a fox", "--out", str(out), *FAST])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 1
    assert "cannot write" in line and "No space left on device" in line
    assert list(out.iterdir()) == []  # no partial file, not even the hidden .part


def test_ctrl_c_while_writing_leaves_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Path, "write_bytes", _fail_while_writing(KeyboardInterrupt()))
    out = tmp_path / "out"
    assert main(["--out", str(out), *FAST]) == 130
    assert capsys.readouterr().err.strip() == "bcg-generate: interrupted"
    assert list(out.iterdir()) == []


def test_ctrl_c_while_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(generation_prepare, "build_model", interrupted)
    assert main(["--out", str(tmp_path / "out"), *FAST]) == 130
    assert capsys.readouterr().err.strip() == "bcg-generate: interrupted"
    assert not (tmp_path / "out").exists()


def test_failures_inside_the_libraries_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import ZImagePipeline

    import accel

    def no_denoiser(pipe: Any, **kwargs: Any) -> None:
        raise ValueError("ZImagePipeline has no denoiser to accelerate")

    def out_of_memory(self: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def needs_an_image(self: Any, **kwargs: Any) -> None:
        raise TypeError("__call__() missing 1 required positional argument: 'image'")

    with monkeypatch.context() as m:
        m.setattr(accel, "accelerate_pipeline", no_denoiser)
        rc, line = _run_bad(tmp_path, [], capsys)
        assert rc == 1 and "cannot accelerate ZImagePipeline" in line and "--mode eager" in line
    with monkeypatch.context() as m:
        m.setattr(ZImagePipeline, "__call__", out_of_memory)
        rc, line = _run_bad(tmp_path, ["--batch-size", "3"], capsys)
        assert rc == 1 and "out of memory generating 3 image(s) at 64x64" in line
    with monkeypatch.context() as m:
        m.setattr(ZImagePipeline, "__call__", needs_an_image)
        rc, line = _run_bad(tmp_path, [], capsys)
        assert rc == 1 and "ZImagePipeline refused the call" in line and "'image'" in line


@pytest.mark.skipif(not NO_CUDA, reason="the CPU notice is for machines without CUDA")
def test_cpu_run_says_once_that_graphs_are_off(tmp_path: Path) -> None:
    """Visible at the default log level and with --quiet: a WARNING, said once."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pipelines.cli", "--resolution", "64x64", "--steps", "2", "--quiet",
           "--out", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stderr.splitlines() if "CUDA graphs are off" in line]
    assert len(notices) == 1 and "WARNING" in notices[0], proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# Inputs that work, and say what they do
# --------------------------------------------------------------------------------------------
def test_negative_prompt_without_guidance_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "n.png"
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--negative-prompt", "blurry", "--out", str(out), *FAST]) == 0
    assert "--negative-prompt is ignored" in caplog.text
    assert png_text(out)["negative_prompt"] == ""  # the metadata says what was used


def test_a_quoted_tilde_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shell expands ~ only unquoted; --out "~/fox.png" once made a folder named '~'."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (home / "prompts.txt").write_text("a fox at home\n", encoding="utf-8")
    assert main(["--out", "~/fox.png", "--prompts-file", "~/prompts.txt", *FAST]) == 0
    assert png_text(home / "fox.png")["prompt"] == "a fox at home"
    assert list(work.iterdir()) == []


@pytest.mark.skipif(not NO_CUDA, reason="graphs are captured on a CUDA device")
def test_warmup_without_cuda_says_it_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--warmup", "64x64", "--out", str(tmp_path / "w.png"), *FAST]) == 0
    assert "--warmup is ignored: graphs are captured only on a CUDA device" in caplog.text


def test_warmup_passes_the_runs_prompts_frames_and_guidance() -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []
    pipe = types.SimpleNamespace(accel=types.SimpleNamespace(warmup=lambda res, **kw: calls.append((res, kw))))
    jobs = plan_jobs(["a red fox", "a blue bird", "a red fox"], [(64, 64)], 2, 0)
    prompts = [j.prompt for j in jobs]
    generation_prepare._warmup(pipe, [(64, 64)], prompts, "blurry", True, 2, 9, False)
    generation_prepare._warmup(pipe, [(64, 64)], prompts, None, False, 1, None, False)
    (res, video), (_, image) = calls
    assert res == [(64, 64)] and video["prompts"] == ["a red fox", "a blue bird"]
    assert (video["num_frames"], video["cfg"], video["negative_prompt"], video["batch_sizes"]) == (
        9,
        True,
        "blurry",
        (2,),
    )
    assert "num_frames" not in image and image["cfg"] is False


@pytest.mark.parametrize(
    ("pipeline", "kwarg", "above", "guidance", "negative", "runs"),
    [
        ("StableDiffusion3Pipeline", "guidance_scale", 1.0, None, None, True),  # its call's default: 7.0
        ("PixArtSigmaPipeline", "guidance_scale", 1.0, None, None, True),  # 4.5
        ("WanPipeline", "guidance_scale", 1.0, 1.0, None, False),
        ("WanPipeline", "guidance_scale", 1.0, 5.0, None, True),
        ("HunyuanVideoPipeline", "true_cfg_scale", 1.0, None, " ", False),  # true_cfg_scale defaults to 1.0
        ("QwenImagePipeline", "true_cfg_scale", 1.0, None, None, False),  # 4.0, but no negative prompt
        ("QwenImagePipeline", "true_cfg_scale", 1.0, None, " ", True),
        ("FluxPipeline", "guidance_scale", math.inf, 3.5, None, False),  # the distilled embedding
        ("HunyuanVideo15Pipeline", None, 1.0, None, None, False),  # its guider decides, no argument
    ],
)
def test_the_warmups_guidance_is_what_the_runs_calls_do(pipeline, kwarg, above, guidance, negative, runs) -> None:
    import diffusers

    params = inspect.signature(getattr(diffusers, pipeline).__call__).parameters
    assert generation_calls.runs_cfg(guidance, kwarg, above, params, negative) is runs


def test_prompts_starting_with_a_dash_and_unicode(tmp_path: Path) -> None:
    rc = main(["--prompt", "-fox", "--prompt", "一只红狐狸 🦊", "--out", str(tmp_path), *FAST])
    assert rc == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["0000-fox-64x64-s0.png", "0001-image-64x64-s1.png"]
    assert png_text(tmp_path / names[0])["prompt"] == "-fox"
    assert png_text(tmp_path / names[1])["prompt"] == "一只红狐狸 🦊"


@pytest.mark.parametrize(
    "prompt, name",
    [
        ("ein Fuchs über Schnee", "ein-fuchs-uber-schnee"),  # once ein-fuchs-ber-schnee
        ("naïve café", "naive-cafe"),  # once na-ve-caf
        ("Crème Brûlée!", "creme-brulee"),
        ("Straße", "strasse"),
        ("Ærøskøbing", "aeroskobing"),  # letters NFKD leaves whole, spelled out
        ("Łódź", "lodz"),
        ("İstanbul", "istanbul"),  # case folding makes a combining dot, dropped too
        ("ﬁne ½", "fine-1-2"),  # compatibility forms: NFKD, not NFD
        ("Привет fox", "fox"),  # no ASCII base: left out
        ("一只红狐狸 🦊", "image"),
    ],
)
def test_file_names_keep_accented_words_by_their_base_letters(prompt: str, name: str) -> None:
    assert slug(prompt) == name


def test_compile_options_reach_accelerate_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import accel

    seen: list[dict[str, Any]] = []
    original = accel.accelerate_pipeline

    def record(pipe: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(pipe, **kwargs)

    monkeypatch.setattr(accel, "accelerate_pipeline", record)
    cache = tmp_path / "cache"
    assert main(["--out", str(tmp_path / "a"), *FAST]) == 0
    assert main(["--compile", "--compile-cache", str(cache), "--out", str(tmp_path / "b"), *FAST]) == 0
    assert seen[0] == {"mode": "bcg"}  # not passed unless asked for
    assert seen[1] == {"mode": "bcg", "compile": True, "compile_cache_dir": cache}


def test_graph_options_reach_accelerate_pipeline_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import accel

    seen: list[tuple[dict[str, Any], Any]] = []
    original = accel.accelerate_pipeline

    def record(pipe: Any, **kwargs: Any) -> Any:
        seen.append((kwargs, pipe))
        return original(pipe, **kwargs)

    monkeypatch.setattr(accel, "accelerate_pipeline", record)
    assert main(["--report", "--out", str(tmp_path / "a"), *FAST]) == 0
    (kwargs, pipe), report = seen[-1], capsys.readouterr().out
    assert kwargs == {"mode": "bcg"}  # the defaults are not passed
    assert (pipe.accel.options.text_encoder, pipe.accel.options.vae, pipe.accel.options.auto_breaks) == (
        True, True, True)  # fmt: skip
    # Runners are listed denoiser first, then each graphed component.
    assert report.index("  transformer (") < report.index("  text_encoder (") < report.index("  vae.decoder (")

    argv = ["--no-text-encoder-graphs", "--no-vae-graphs", "--no-auto-breaks", "--no-cfg-batch", "--report"]
    assert main([*argv, "--out", str(tmp_path / "b"), *FAST]) == 0
    (kwargs, pipe), report = seen[-1], capsys.readouterr().out
    assert kwargs == {"mode": "bcg", "text_encoder": False, "vae": False, "auto_breaks": False, "cfg_batch": False}
    assert (pipe.accel.options.text_encoder, pipe.accel.options.vae, pipe.accel.options.auto_breaks) == (
        False, False, False)  # fmt: skip
    assert pipe.accel.options.cfg_batch is False
    assert list(pipe.accel.runners) == ["transformer"]
    assert "  transformer (" in report and "text_encoder" not in report and "vae.decoder" not in report

    # --mode eager still leaves the pipeline alone; asking for fewer graphs there is harmless.
    n = len(seen)
    eager = ["--no-text-encoder-graphs", "--no-vae-graphs", "--no-auto-breaks", "--mode", "eager", "--report"]
    assert main([*eager, "--out", str(tmp_path / "c"), *FAST]) == 0
    assert len(seen) == n
    assert "mode eager: the pipeline was not accelerated" in capsys.readouterr().out


def test_help_lists_the_graph_options() -> None:
    args = build_parser().parse_args([])
    assert (args.text_encoder_graphs, args.vae_graphs, args.auto_breaks, args.cfg_batch) == (True, True, True, True)
    text = build_parser().format_help()
    for flag in ("--no-text-encoder-graphs", "--no-vae-graphs", "--no-cfg-batch", "--no-auto-breaks"):
        assert flag in text, flag
    # In the acceleration options, after --compile-cache and before --device.
    order = ["\n  --compile-cache DIR", "\n  --no-text-encoder-graphs", "\n  --no-vae-graphs", "\n  --no-cfg-batch",
             "\n  --no-auto-breaks", "\n  --device DEVICE"]  # fmt: skip
    assert [text.index(o) for o in order] == sorted(text.index(o) for o in order)


def test_a_compile_cache_variable_naming_a_file_is_refused_with_compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile-cache FILE was refused, BCG_COMPILE_CACHE=FILE accepted (and shown as the folder)."""
    cache = tmp_path / "a-file"
    cache.write_text("x")
    monkeypatch.setenv("BCG_COMPILE_CACHE", str(cache))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    rc, line = _run_bad(tmp_path, ["--compile"], capsys)
    assert rc == 2 and f"$BCG_COMPILE_CACHE {str(cache)!r} is an existing file, not a folder" in line
    assert "$BCG_COMPILE_CACHE names a file, not a folder: --compile refuses it" in build_parser().format_help()
    monkeypatch.setenv("BCG_COMPILE_CACHE", str(tmp_path / "a-file" / "sub"))
    rc, line = _run_bad(tmp_path, ["--compile"], capsys)
    assert rc == 2 and "cannot be created" in line


def test_help_says_where_the_compile_cache_is_and_the_limits() -> None:
    text = build_parser().format_help()
    assert str(default_compile_cache_dir()) in text
    assert "Delete that folder to clear the cache" in text
    for needle in ("8192x8192", "axes_lens", "num_train_timesteps", "2**63 - 1", "needs a CUDA GPU"):
        assert needle in text, needle


def test_a_ten_thousand_line_prompts_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"prompt number {i}\n" for i in range(10_000)), encoding="utf-8")
    prompts = read_prompts_file(path)
    jobs = plan_jobs(prompts, [(64, 64), (128, 64)], 2, 0)
    names = _names(jobs)
    assert len(prompts) == 10_000 and len(names) == len(set(names)) == 40_000


# --------------------------------------------------------------------------------------------
# Limits (pipelines.limits), each from the model or the machine
# --------------------------------------------------------------------------------------------
def test_position_limits_come_from_the_models_rope_tables() -> None:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    z = limits.embedded_position_limit("z-image", "full")
    assert z is not None and (z.max_width, z.max_height) == (8192, 8192)  # axes_lens 512 x 16 pixels
    # diffusers' table: whatever its size, the limit follows it.
    rows = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True).pos_freqs.shape[0]
    q = limits.embedded_position_limit("qwen-image", "full")
    assert q is not None and q.max_width == (2 * (rows - limits.MAX_TEXT_TOKENS) + 1) * 16
    q.check(q.max_width, q.max_height)
    with pytest.raises(limits.LimitError, match="RoPE table"):
        q.check(q.max_width + 16, 64)


def test_seed_and_step_limits() -> None:
    limits.check_seeds(limits.MAX_SEED, 1)
    limits.check_seeds(limits.MAX_SEED - 9, 10)
    with pytest.raises(limits.LimitError):
        limits.check_seeds(limits.MAX_SEED - 8, 10)
    limits.check_steps(1000, {"num_train_timesteps": 1000})
    with pytest.raises(limits.LimitError, match="1 to 50"):
        limits.check_steps(51, {"num_train_timesteps": 50})


@pytest.mark.parametrize("model,measured_mib", [("z-image", 2738.0), ("qwen-image", 4537.0)])
def test_memory_estimate_covers_the_measured_peak(model: str, measured_mib: float) -> None:
    """Full-size models at 1024x1024 in bf16 (built on the meta device, no storage) against the
    end-to-end peaks above the weights measured on an H200 (samples/bench/results.json)."""
    from pipelines.builders import build_transformer, build_vae

    pipe = types.SimpleNamespace(
        vae=build_vae(model, "full", device="meta", dtype=torch.bfloat16),
        transformer=build_transformer(model, "full", device="meta", dtype=torch.bfloat16),
        vae_scale_factor=8,
    )
    estimate = limits.estimate_activation_bytes(pipe, 1024, 1024, 1, cfg=False, graphs=False)
    assert measured_mib <= estimate.total / 2**20 <= 2 * measured_mib
    # Twice the pixels, about twice the memory; a batch of two, twice the memory.
    wide = limits.estimate_activation_bytes(pipe, 2048, 1024, 1, cfg=False, graphs=False)
    batch = limits.estimate_activation_bytes(pipe, 1024, 1024, 2, cfg=False, graphs=False)
    assert 1.8 < wide.total / estimate.total < 2.2 and 1.8 < batch.total / estimate.total < 2.2


# --------------------------------------------------------------------------------------------
# Splitting work across processes
# --------------------------------------------------------------------------------------------
def _names(jobs: list[Job]) -> list[str]:
    return [name for job in jobs for name in file_names(job)]


@pytest.mark.parametrize("n_prompts,n_res,batch,procs", [(2, 1, 1, 2), (3, 2, 2, 2), (5, 1, 1, 3), (1, 1, 4, 2)])
def test_shard_covers_every_job_once(n_prompts: int, n_res: int, batch: int, procs: int) -> None:
    prompts = [f"prompt {i}" for i in range(n_prompts)]
    resolutions = [(64, 64), (128, 64)][:n_res]
    jobs = plan_jobs(prompts, resolutions, batch, seed=5)
    single = _names(jobs)
    assert len(set(single)) == len(single) == n_prompts * n_res * batch
    parts = [shard(jobs, i, procs) for i in range(procs)]
    assert [j for part in parts for j in part] == jobs  # contiguous, in order, each once
    assert sorted(n for part in parts for n in _names(part)) == sorted(single)
    # Image i of the run uses seed + i whichever process makes it.
    assert all(s == 5 + i for job in jobs for i, s in zip(job.indices, job.seeds))


def test_shard_matches_accelerate_split() -> None:
    from accelerate import PartialState

    jobs = plan_jobs([f"p{i}" for i in range(7)], [(64, 64)], 1, 0)
    for procs in (1, 2, 3, 4):
        for index in range(procs):
            fake = types.SimpleNamespace(num_processes=procs, process_index=index)
            with PartialState.split_between_processes(fake, jobs) as theirs:
                assert shard(jobs, index, procs) == list(theirs)


def test_two_process_accelerate_launch(tmp_path: Path) -> None:
    """A real ``accelerate launch`` with two processes on the CPU (gloo).

    ``accelerate launch --cpu --num_processes 2`` starts ONE process (accelerate's simple
    launcher; several CPU processes need mpirun), so this uses torchrun through ``--multi_gpu``,
    which on a machine without GPUs makes a gloo group on the CPU.
    """
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\na blue bird\n", encoding="utf-8")
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        launch += ["--multi_gpu"]
    cmd = [*launch, str(ROOT / "scripts" / "generate.py"), "--prompts-file", str(prompts),
           "--resolution", "64x64", "--steps", "2", "--device", "cpu", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Both processes ran, each with one of the two jobs.
    assert "[rank 0/2] 1 image(s)" in proc.stdout and "[rank 1/2] 1 image(s)" in proc.stdout, proc.stdout
    expected = _names(plan_jobs(["a red fox", "a blue bird"], [(64, 64)], 1, 0))
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    assert png_text(out / expected[1])["prompt"] == "a blue bird"
