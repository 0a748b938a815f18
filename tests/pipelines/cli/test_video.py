"""bcg-generate and a video model (the tiny Wan2.1, CPU): every frame written, as animated WebP
(the default), GIF or MP4, the container from --out's suffix; frame count, size and rate read
back with Pillow and imageio; the run's text in each container's metadata field; the bad inputs
refused before the build in one line; no clobbering, and no partial file."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.cli import video as cli_video
from pipelines.cli.jobs import plan_jobs
from pipelines.cli.video import (
    VideoOutput,
    default_fps,
    frame_durations,
    read_video_text,
    settle_video_output,
)
from pipelines.generation import call_settings
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.defaults import is_video_model
from pipelines.generation.errors import InputError

PROMPT, SEED, FRAMES = "a boat on a lake", 3, 9
FAST = ["--model", "wan", "--resolution", "64x64", "--steps", "2", "--quiet"]
RUN = [*FAST, "--prompt", PROMPT, "--seed", str(SEED), "--frames", str(FRAMES)]


@pytest.fixture(scope="module")
def stock_frames() -> np.ndarray:
    """The stock pipeline's frames as uint8, (frames, H, W, 3), called as the CLI calls it."""
    pipe = build_pipeline("wan", "tiny")
    pipe.set_progress_bar_config(disable=True)
    (job,) = plan_jobs([PROMPT], [(64, 64)], 1, SEED)
    kwargs = call_settings(pipe, "wan", "tiny", steps=2, frames=FRAMES).kwargs(job, torch.device("cpu"))
    frames = np.asarray(pipe(**kwargs).frames)[0]
    return (frames * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil makes them


def _pillow_frames(path: Path) -> tuple[list[np.ndarray], list[int], tuple[int, int]]:
    frames, durations = [], []
    with Image.open(path) as im:
        size = im.size
        for i in range(im.n_frames):
            im.seek(i)
            im.load()
            durations.append(im.info["duration"])
            frames.append(np.asarray(im.convert("RGB")))
    return frames, durations, size


def _check_text(text: dict[str, str], fps: str) -> None:
    assert (text["prompt"], text["seed"], text["steps"], text["model"]) == (PROMPT, str(SEED), "2", "wan")
    assert (text["frames"], text["fps"], text["guidance"], text["resolution"]) == (str(FRAMES), fps, "5", "64x64")
    assert text["mode"] == "eager" and text["Software"].startswith("bcg-diffusers ")


def test_webp_holds_every_frame_exactly(tmp_path: Path, stock_frames: np.ndarray, capsys: Any) -> None:
    out = tmp_path / "a.webp"
    assert main([*RUN, "--out", str(out)]) == 0
    frames, durations, size = _pillow_frames(out)
    assert len(frames) == FRAMES and size == (64, 64)
    assert np.array_equal(np.stack(frames), stock_frames)  # lossless: the pipeline's frames as uint8
    # 16 fps, Wan's default: 62.5 ms a frame, each frame ending at its own time rounded to a millisecond.
    assert durations == [62, 63, 63, 62, 62, 63, 63, 62, 62] and sum(durations) == round(FRAMES * 1000 / 16)
    _check_text(read_video_text(out), "16")
    with Image.open(out) as im:  # where the README says it is: EXIF ImageDescription, as JSON
        assert json.loads(im.getexif()[0x010E])["prompt"] == PROMPT
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}")
    assert [p.name for p in tmp_path.iterdir()] == ["a.webp"]  # no .part left


def test_mp4_is_h264_at_the_frame_rate_asked(tmp_path: Path, stock_frames: np.ndarray) -> None:
    out = tmp_path / "a.mp4"
    assert main([*RUN, "--fps", "12.5", "--out", str(out)]) == 0
    meta = iio.immeta(out, plugin="FFMPEG")
    assert (meta["codec"], meta["fps"], meta["size"]) == ("h264", 12.5, (64, 64))
    decoded = iio.imread(out, plugin="FFMPEG").astype(np.int16)
    assert decoded.shape == (FRAMES, 64, 64, 3)
    # H.264 (yuv420p, crf 17) is lossy, so frames cannot be equal: each decoded frame must be
    # nearer its own frame than any other (none dropped, doubled or reordered), and near it.
    source = stock_frames.astype(np.int16)
    error = np.abs(decoded[:, None] - source[None]).mean(axis=(2, 3, 4))  # (decoded, source)
    assert list(error.argmin(axis=1)) == list(range(FRAMES)), error.round(1)
    assert error.diagonal().max() < 0.5 * np.median(error[~np.eye(FRAMES, dtype=bool)]), error.round(1)
    _check_text(read_video_text(out), "12.5")


def test_gif_and_a_folder_of_videos(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "a.gif"
    assert main([*RUN, "--fps", "8", "--out", str(out)]) == 0
    frames, durations, size = _pillow_frames(out)
    # GIF keeps 256 colours a frame (no exact pixels); its times are hundredths of a second.
    assert len(frames) == FRAMES and size == (64, 64) and durations == [120, 130, 130, 120] * 2 + [120]
    assert sum(durations) == 1120  # 9 frames at 8 fps: 1125 ms, to the hundredth (half to even)
    _check_text(read_video_text(out), "8")
    with Image.open(out) as im:
        assert json.loads(im.info["comment"])["fps"] == "8"

    folder = tmp_path / "videos"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bcg-generate"):
        argv = [*FAST, "--prompt", PROMPT, "--frames", "5", "--steps", "1", "--batch-size", "2", "--out", str(folder)]
        assert main(argv) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["0000-a-boat-on-a-lake-64x64-s0.webp", "0001-a-boat-on-a-lake-64x64-s1.webp"]  # WebP by default
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote ")] == [
        f"wrote {folder / n}" for n in names
    ]
    for name in names:
        assert _pillow_frames(folder / name)[0].__len__() == 5
        assert read_video_text(folder / name)["seed"] == name.split("-s")[-1].removesuffix(".webp")


def test_png_writes_the_first_frame_and_says_so_once(
    tmp_path: Path, stock_frames: np.ndarray, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "a.png"
    assert main([*RUN, "--out", str(out)]) == 0
    with Image.open(out) as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), stock_frames[0])
        assert im.text["frames"] == f"{FRAMES} generated, the first written"
    said = [r.getMessage() for r in caplog.records if "first frame is written" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"--out {out} holds one image"), said


def test_existing_videos_are_kept_and_the_new_one_takes_a_free_name(tmp_path: Path) -> None:
    out = tmp_path / "a.webp"
    out.write_bytes(b"made earlier")
    folder = tmp_path / "videos"
    folder.mkdir()
    (folder / "0000-a-boat-on-a-lake-64x64-s3.webp").write_bytes(b"made earlier")
    assert main([*RUN, "--frames", "1", "--steps", "1", "--out", str(out)]) == 0
    assert out.read_bytes() == b"made earlier" and read_video_text(str(tmp_path / "a-1.webp"))["frames"] == "1"
    assert main([*RUN, "--frames", "1", "--steps", "1", "--overwrite", "--out", str(out)]) == 0
    assert read_video_text(out)["frames"] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1.webp", "a.webp", "videos"]


def test_ctrl_c_while_a_video_is_written_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_ctrl_c(frames: Any, part: Path, text: Any, fps: float) -> None:
        part.write_bytes(b"RIFF half a video")
        raise KeyboardInterrupt

    monkeypatch.setitem(cli_video._WRITERS, ".webp", half_then_ctrl_c)
    folder = tmp_path / "out"
    assert main([*FAST, "--frames", "1", "--steps", "1", "--out", str(folder)]) == 130
    assert list(folder.iterdir()) == []  # neither the video nor its hidden .part


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before anything is built
# --------------------------------------------------------------------------------------------
BEFORE_BUILD = [
    ("fps zero", ["--fps", "0"], "argument --fps: '0': must be a finite number above 0"),
    ("fps negative", ["--fps", "-5"], "argument --fps: '-5': must be a finite number above 0"),
    ("fps nan", ["--fps", "nan"], "argument --fps: 'nan' is not a finite number"),
    ("fps not a number", ["--fps", "fast"], "argument --fps: 'fast' is not a number"),
    ("fps over gif's", ["--fps", "120", "--out", "{tmp}/a.gif"], "GIF stores frame times in whole hundredths"),
    ("fps over webp's", ["--fps", "1001"], "WebP stores frame times in whole milliseconds, so at most 1000 fps"),
    ("fps for a first frame", ["--fps", "8", "--out", "{tmp}/a.png"], "writes each video's first frame only"),
    ("fps for an image model", ["--model", "z-image", "--fps", "8"], "--fps 8 sets a video's frame rate, but z-image"),
    ("frames not 4k+1", ["--frames", "6"], "so a video has 4k+1 frames: use 5 or 9 (valid: 1, 5, 9, 13, 17, ...)"),
    ("frames for an image model", ["--model", "z-image", "--frames", "5"], "ZImagePipeline makes images, not videos"),
    ("several videos, one file", ["--batch-size", "2", "--out", "{tmp}/a.webp"], "this run makes 2 videos"),
    ("bmp for a video", ["--out", "{tmp}/a.bmp"], "a video is written as .webp, .gif or .mp4"),
    ("gif for images", ["--model", "z-image", "--out", "{tmp}/a.gif"], "images are written as PNG, JPEG or WebP"),
]


@pytest.mark.parametrize("case", BEFORE_BUILD, ids=[c[0] for c in BEFORE_BUILD])
def test_bad_input_is_one_line_before_building(
    case: tuple[str, list[str], str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    _, argv, expected = case

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    base = [*FAST[FAST.index("--resolution") :], *([] if "--out" in argv else ["--out", str(tmp_path / "out")])]
    model = [] if "--model" in argv else ["--model", "wan"]
    assert main([*model, *argv, *base]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bcg-generate: error: "), err
    assert expected in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_mp4_without_the_extra_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "imageio_ffmpeg" else real(n, *a))
    monkeypatch.setattr(generation_prepare, "build_model", lambda *a, **k: pytest.fail("built"))
    assert main([*RUN, "--out", str(tmp_path / "a.mp4")]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "bcg-generate: error: --out .mp4 writes H.264 through imageio and imageio-ffmpeg, which are not installed "
        '(imageio-ffmpeg): pip install "bcg-diffusers[video]", or write .webp'
    )
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------------
def test_frame_times_add_up_without_drift() -> None:
    assert frame_durations(4, 16, 1) == [62, 63, 63, 62]
    assert frame_durations(3, 30, 10) == [30, 40, 30]  # 33.3 ms in hundredths of a second
    for fps, unit in ((16, 1), (24, 1), (29.97, 1), (7, 10), (16, 10)):
        durations = frame_durations(81, fps, unit)
        assert sum(durations) == unit * round(81 * 1000 / fps / unit) and min(durations) > 0


def test_default_frame_rates() -> None:
    import diffusers

    assert default_fps(diffusers.WanPipeline) == (16.0, "diffusers' example for WanPipeline")
    assert default_fps(diffusers.LTXPipeline) == (25.0, "LTXPipeline's frame_rate default")  # what it is told

    class Unknown:
        def __call__(self, num_frames: int = 5) -> None: ...

    assert default_fps(Unknown)[0] == 16.0


def test_a_model_known_only_once_built(tmp_path: Path) -> None:
    """A hub model: planned as a video; an image pipeline then writes PNGs, or refuses a video file."""
    for name, video in (("WanPipeline", True), ("ZImagePipeline", False), ("NoSuchPipeline", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps({"_class_name": name}))
        assert is_video_model(str(tmp_path / name)) is video
    assert is_video_model("some-org/some-model") is None and is_video_model("wan") is True

    class ImagePipe:
        def __call__(self, prompt: str = "") -> None: ...

    class VideoPipe:
        def __call__(self, prompt: str = "", num_frames: int = 5) -> None: ...

    plan = VideoOutput(".webp")
    assert settle_video_output(plan, VideoPipe(), None, None) is plan
    assert settle_video_output(plan, ImagePipe(), None, None) is None
    with pytest.raises(InputError, match="ImagePipe makes images, written as PNG, JPEG or WebP"):
        settle_video_output(plan, ImagePipe(), tmp_path / "a.gif", None)
    assert settle_video_output(plan, ImagePipe(), tmp_path / "a.webp", None) is None  # a WebP image
    with pytest.raises(InputError, match="--fps 8 sets a video's frame rate, but ImagePipe makes images"):
        settle_video_output(plan, ImagePipe(), None, 8.0)


def test_fps_reaches_a_model_conditioned_on_its_frame_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """LTX-Video takes ``frame_rate`` (its rotary positions are scaled by it): --fps is the file's
    rate and the call's, warm-up calls included; Wan takes none, and its call is as without --fps."""
    pipe = build_pipeline("wan", "tiny")
    pipe.set_progress_bar_config(disable=True)
    (job,) = plan_jobs([PROMPT], [(64, 64)], 1, SEED)
    plain = call_settings(pipe, "wan", "tiny", steps=2, frames=FRAMES, fps=24.0)
    assert plain.frame_rate is None and "frame_rate" not in plain.kwargs(job, torch.device("cpu"))

    seen: list[Any] = []

    class ConditionedOnRate(type(pipe)):  # type: ignore[misc]
        def __call__(self, *args: Any, frame_rate: int = 25, **kwargs: Any) -> Any:
            seen.append(frame_rate)
            return super().__call__(*args, **kwargs)

    # Wan's own call, with LTX-Video's frame_rate beside its arguments.
    stock = inspect.signature(type(pipe).__call__)
    rate = inspect.Parameter("frame_rate", inspect.Parameter.KEYWORD_ONLY, default=25, annotation=int)
    params = [p for p in stock.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    ConditionedOnRate.__call__.__signature__ = stock.replace(parameters=[*params, rate])  # type: ignore[attr-defined]
    pipe.__class__ = ConditionedOnRate
    call = call_settings(pipe, "wan", "tiny", steps=2, frames=FRAMES, fps=24.0)
    kwargs = call.kwargs(job, torch.device("cpu"))
    assert kwargs["frame_rate"] == 24 and type(kwargs["frame_rate"]) is int  # LTX's is an int
    assert call_settings(pipe, "wan", "tiny", fps=29.97).frame_rate == ("frame_rate", 29.97)
    assert "frame_rate" not in call_settings(pipe, "wan", "tiny", steps=2, frames=FRAMES).kwargs(job, "cpu")

    warmed: dict[str, Any] = {}

    class Accel:
        def warmup(self, resolutions: Any, **kw: Any) -> None:
            warmed.update(kw)

    monkeypatch.setattr(pipe, "accel", Accel(), raising=False)
    generation_prepare._warmup(pipe, [(64, 64)], [PROMPT], None, False, 1, FRAMES, False, call.conditioning())
    assert warmed["call_kwargs"] == {"frame_rate": 24} and warmed["num_frames"] == FRAMES

    frames = np.asarray(pipe(**kwargs).frames)[0]
    assert seen == [24] and frames.shape[0] == FRAMES
