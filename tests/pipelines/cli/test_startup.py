"""bcg-generate before and around the work (CPU): --help and argument errors import no torch, a
Ctrl-C while the libraries load and a SIGTERM at any time end in one line with 130 / 143 and no
partial file, and the constants the parser mirrors stay equal to the ones they mirror."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from pipelines.cli import main
from pipelines.generation import prepare as generation_prepare

ROOT = Path(__file__).resolve().parents[3]
FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]
HEAVY = ("torch", "diffusers", "transformers", "accel")


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_help_and_argument_errors_import_no_torch() -> None:
    """torch and diffusers take 3-5 s to import: --help and a mistyped value must not wait for them."""
    proc = _python(f"""
        import sys
        from pipelines.cli import main
        codes = [main(["--help"]), main(["--version"]), main(["--steps", "many"]), main(["--resolution", "500x512"]),
                 main(["--seed", "-1"]), main(["--cache", "fbc", "--cache-interval", "2"]), main(["--bogus"])]
        print(codes, [m for m in {HEAVY!r} if m in sys.modules])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 2, 2, 2, 2, 2] []", proc.stdout[-2000:]
    assert f"\nbcg-generate {version('bcg-diffusers')}\n" in proc.stdout  # after the --help text
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 5 and all(e.startswith("bcg-generate: error: ") for e in errors), proc.stderr
    assert "'many' is not an integer" in errors[0] and "positive multiples of 16" in errors[1]


def test_what_the_flags_and_the_models_name_tell_is_refused_before_torch(tmp_path: Path) -> None:
    """--frames 17 for z-image once waited 4.5 s for torch and diffusers before it was refused."""
    out = str(tmp_path / "x.png")
    proc = _python(f"""
        import sys
        from pipelines.cli import main
        codes = [main(["--prompt", "x", "--frames", "17", "--out", {out!r}]),
                 main(["--model", "Z_Image", "--frames", "5", "--out", {out!r}]),
                 main(["--model", "wan", "--frames", "6", "--out", {out!r}]),
                 main(["--model", "flux", "--fps", "8", "--out", {out!r}]),
                 main(["--out", {str(tmp_path / "x.bmp")!r}])]
        print(codes, [m for m in {HEAVY!r} if m in sys.modules])
    """)
    assert proc.stdout.strip() == "[2, 2, 2, 2, 2] []", proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = proc.stderr.strip().splitlines()
    assert errors == [
        "bcg-generate: error: --frames 17: ZImagePipeline makes images, not videos (--frames is for video models: "
        "wan, wan-1.3b)",
        "bcg-generate: error: --frames 5: ZImagePipeline makes images, not videos (--frames is for video models: "
        "wan, wan-1.3b)",
        "bcg-generate: error: --frames 6: WanPipeline's VAE packs 4 frames into each latent frame after the first, "
        "so a video has 4k+1 frames: use 5 or 9 (valid: 1, 5, 9, 13, 17, ...)",
        "bcg-generate: error: --fps 8 sets a video's frame rate, but flux makes images",
        f"bcg-generate: error: --out {str(tmp_path / 'x.bmp')!r}: images are written as PNG, JPEG or WebP; use "
        f"{out!r} (or a folder)",
    ]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path: Path) -> None:
    """The first seconds of a run import torch and diffusers; a Ctrl-C then once printed a
    35-56 line traceback. The import of torch is made to raise KeyboardInterrupt, as a Ctrl-C
    during it would."""
    proc = _python(f"""
        import sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    raise KeyboardInterrupt
                return None

        sys.meta_path.insert(0, CtrlC())
        from pipelines.cli import main
        sys.exit(main(["--out", {str(tmp_path / "out")!r}, "--quiet"]))
    """)
    assert (proc.returncode, proc.stderr.strip()) == (130, "bcg-generate: interrupted"), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_sigterm_while_building_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = signal.getsignal(signal.SIGTERM)

    def terminated(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM should have ended the run")

    monkeypatch.setattr(generation_prepare, "build_model", terminated)
    assert main(["--out", str(tmp_path / "out"), *FAST]) == 143
    assert capsys.readouterr().err.strip() == "bcg-generate: terminated"
    assert not (tmp_path / "out").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


def test_sigterm_while_writing_leaves_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_bytes = Path.write_bytes

    def write(self: Path, data: Any) -> int:
        if ".part" not in self.name:
            return write_bytes(self, data)
        written = write_bytes(self, b"\x89PNG half an image")
        os.kill(os.getpid(), signal.SIGTERM)
        return written

    monkeypatch.setattr(Path, "write_bytes", write)
    out = tmp_path / "out"
    assert main(["--out", str(out), *FAST]) == 143
    assert capsys.readouterr().err.strip() == "bcg-generate: terminated"
    assert list(out.iterdir()) == []  # not the image, not its hidden .part


def test_the_parsers_constants_equal_what_they_mirror() -> None:
    import accel.hooks.options
    from pipelines import limits
    from pipelines.generation import constants

    assert (constants.MAX_SEED, constants.MAX_STEPS, constants.MEMORY_MARGIN, constants.MAX_GUIDANCE) == (
        limits.MAX_SEED, limits.DEFAULT_MAX_STEPS, limits.MEMORY_MARGIN, limits.MAX_GUIDANCE)  # fmt: skip
    light = constants.accel_options()
    for name in ("MODES", "PARALLEL_MODES", "RESOLUTION_MULTIPLE", "COMPILE_CACHE_ENV"):
        assert getattr(light, name) == getattr(accel.hooks.options, name), name
    assert light.default_compile_cache_dir() == accel.hooks.options.default_compile_cache_dir()
    for text in ("512x512", " 64 X 96 ", "500x512", "-5x5", "axb"):
        try:
            expected: Any = accel.hooks.options.parse_resolution(text)
        except ValueError as e:
            expected = str(e)
        try:
            got: Any = light.parse_resolution(text)
        except ValueError as e:
            got = str(e)
        assert got == expected, text


def test_held_library_warnings_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """diffusers warns of float16 on a CPU once for each component it moves: three times."""
    import logging

    from pipelines.generation import loading

    def load() -> str:
        for _ in range(3):
            logging.getLogger("diffusers.pipelines.pipeline_utils").warning("float16 cannot run on cpu")
        logging.getLogger("diffusers.pipelines.pipeline_utils").warning("another warning")
        return "pipe"

    with caplog.at_level(logging.WARNING):
        assert loading._load_quietly(load) == "pipe"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["float16 cannot run on cpu", "another warning"]


def test_a_closed_stdout_ends_quietly_after_the_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """bcg-generate ... | head: the summary meets a closed pipe once the image is written."""
    with open(tmp_path / "stdout", "w") as file:

        class ClosedPipe:
            def write(self, text: str) -> int:
                raise BrokenPipeError(32, "Broken pipe")

            def flush(self) -> None:
                pass

            def fileno(self) -> int:
                return file.fileno()

        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        assert main(["--out", str(tmp_path / "fox.png"), *FAST]) == 141
    assert (tmp_path / "fox.png").exists()
    assert capsys.readouterr().err == ""  # no traceback, no line: the reader chose to stop
