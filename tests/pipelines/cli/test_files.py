"""bcg-generate and the files it writes (CPU, the tiny model): an existing image is never replaced
without --overwrite (the new one goes to a free name, said before the build, so a command can run
again), a name taken while a run generates (another run writing the same place) is kept and the
new image goes to a free name, each write has a hidden name of its own, one a killed run left is
removed by the next, JPEG and WebP carry the record as PNG does, and the run says which files it
wrote."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from pipelines.cli import files as cli_files
from pipelines.cli import main
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.formats import encode_image

FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]


def png_text(path: Path) -> dict[str, str]:
    with Image.open(path) as im:
        im.load()
        return dict(im.text)


def test_an_existing_image_is_kept_and_overwrite_replaces_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    out = tmp_path / "fox.png"
    out.write_bytes(b"made earlier")
    (tmp_path / "fox-1.png").write_bytes(b"and another")
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--seed", "4", "--out", str(out), *FAST]) == 0  # the same command again: a new name
    assert out.read_bytes() == b"made earlier" and (tmp_path / "fox-1.png").read_bytes() == b"and another"
    assert png_text(tmp_path / "fox-2.png")["seed"] == "4"
    assert f"{out} exists: kept; this run writes {tmp_path / 'fox-2.png'} instead" in caplog.text
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {tmp_path / 'fox-2.png'}")
    assert main(["--seed", "5", "--overwrite", "--out", str(out), *FAST]) == 0
    assert png_text(out)["seed"] == "5"
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox-1.png", "fox-2.png", "fox.png"]  # no .part left


def test_the_readmes_first_command_runs_twice_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's newcomer ran it again and got "outputs/fox.png already exists", status 2."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    command = shlex.split(first.split("&& ")[-1])
    assert command[0] == "bcg-generate"
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main([*command[1:], "--steps", "1", "--quiet"]) == 0
    out = Path(command[command.index("--out") + 1])
    assert sorted(p.name for p in (tmp_path / out.parent).iterdir()) == [f"{out.stem}-1.png", out.name]


def test_existing_images_in_a_folder_each_go_to_a_free_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    names = [f"000{i}-a-fox-64x64-s{i}.png" for i in range(3)]
    for name in (names[0], names[2], "0000-a-fox-64x64-s0-1.png"):
        (out / name).write_bytes(b"earlier")
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--prompt", "a fox", "--batch-size", "3", "--out", str(out), *FAST]) == 0
    assert "(and 1 more of this run's files, each as its first free -N name)" in caplog.text
    made = {p.name: png_text(p)["seed"] for p in out.iterdir() if p.read_bytes() != b"earlier"}
    assert made == {"0000-a-fox-64x64-s0-2.png": "0", names[1]: "1", "0002-a-fox-64x64-s2-1.png": "2"}


def test_a_part_file_a_killed_run_left_is_removed_by_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL gives a run no time to remove its part file: the next run writing there removes
    those of this host whose process is gone, and no other."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = cli_files._host()
    stale = tmp_path / f".fox.png.{host}-{int(dead.stdout)}-0123abcd.part"
    live = tmp_path / f".fox.png.{host}-{os.getpid()}-0123abcd.part"  # a run writing now: this one
    other = tmp_path / f".fox.png.{'0000' if host != '0000' else '0001'}-{int(dead.stdout)}-0123abcd.part"
    old = tmp_path / ".fox.png.0123abcd.part"  # named before part files held their writer
    for part in (stale, live, other, old):
        part.write_bytes(b"half an image")
    os.utime(old, (0, 0))
    assert cli_files.sweep_stale_parts(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    assert main(["--out", str(tmp_path / "fox.png"), *FAST]) == 0
    assert live.exists() and other.exists()


@pytest.mark.parametrize(("suffix", "fmt"), [(".jpg", "JPEG"), (".webp", "WEBP")])
def test_jpeg_and_webp_files_carry_the_record(tmp_path: Path, suffix: str, fmt: str) -> None:
    from pipelines.generation.formats import read_image_text

    out = tmp_path / f"fox{suffix}"
    assert main(["--prompt", "a fox, in snow", "--seed", "3", "--out", str(out), *FAST]) == 0
    with Image.open(out) as im:
        assert (im.format, im.size) == (fmt, (64, 64))
        comment = im.getexif().get_ifd(0x8769)[0x9286]
    text = read_image_text(str(out))
    assert (text["prompt"], text["seed"], text["steps"]) == ("a fox, in snow", "3", "2")
    assert comment == b"UNICODE\0" + text["parameters"].encode("utf-16-be")  # as A1111 writes it
    folder = tmp_path / "many"
    assert main(["--format", fmt.lower(), "--quality", "80", "--num-images", "2", "--out",
                 str(folder), *FAST]) == 0  # fmt: skip
    assert sorted(p.suffix for p in folder.iterdir()) == [suffix, suffix]


def test_a_name_taken_during_the_run_is_kept_and_the_image_goes_to_a_free_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """What two runs into one folder at once do: both pass the check, then the second to finish
    finds the first one's files."""
    out = tmp_path / "out"
    names = ["0000-a-fox-64x64-s0.png", "0001-a-fox-64x64-s1.png"]
    real_build = generation_prepare.build_model

    def build_while_another_run_writes(*args: Any, **kwargs: Any) -> Any:
        pipe = real_build(*args, **kwargs)
        out.mkdir()
        (out / names[0]).write_bytes(b"the other run's image")
        (out / "0000-a-fox-64x64-s0-1.png").write_bytes(b"and its second try")
        return pipe

    monkeypatch.setattr(generation_prepare, "build_model", build_while_another_run_writes)
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(["--prompt", "a fox", "--batch-size", "2", "--out", str(out), *FAST]) == 0
    assert (out / names[0]).read_bytes() == b"the other run's image"
    assert (out / "0000-a-fox-64x64-s0-1.png").read_bytes() == b"and its second try"
    moved = out / "0000-a-fox-64x64-s0-2.png"
    assert png_text(moved)["seed"] == "0" and png_text(out / names[1])["seed"] == "1"
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "0000-a-fox-64x64-s0-1.png", moved.name])
    warnings = [r.getMessage() for r in caplog.records if "appeared while this run was generating" in r.getMessage()]
    assert len(warnings) == 1 and str(moved) in warnings[0]
    summary = capsys.readouterr().out
    assert f"wrote 2 file(s) to {out}{os.sep} (1 under a free name" in summary


def test_two_runs_with_one_png_both_keep_their_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "same.png"
    real_build = generation_prepare.build_model

    def build_while_another_run_writes(*args: Any, **kwargs: Any) -> Any:
        pipe = real_build(*args, **kwargs)
        out.write_bytes(b"the other run's image")
        return pipe

    monkeypatch.setattr(generation_prepare, "build_model", build_while_another_run_writes)
    assert main(["--seed", "9", "--out", str(out), *FAST]) == 0
    assert out.read_bytes() == b"the other run's image"
    assert png_text(tmp_path / "same-1.png")["seed"] == "9"


def test_each_write_has_a_hidden_name_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs writing one name at once once shared '.{name}.part', and one failed with
    'No such file or directory' when the other renamed it away."""
    seen: list[Path] = []
    real_write = Path.write_bytes

    def write_bytes(self: Path, data: Any) -> int:
        seen.append(self)
        assert self.exists()  # created (exclusively) before the PNG's bytes are written into it
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    image = Image.new("RGB", (8, 8))
    first = cli_files.save_png(image, tmp_path / "a.png", {"prompt": "x"})
    second = cli_files.save_png(image, tmp_path / "a.png", {"prompt": "y"})
    assert (first.name, second.name) == ("a.png", "a-1.png")
    assert len(seen) == 2 and seen[0] != seen[1]
    assert all(p.name.startswith(".a.png.") and p.name.endswith(".part") for p in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1.png", "a.png"]
    assert png_text(tmp_path / "a.png")["prompt"] == "x" and png_text(tmp_path / "a-1.png")["prompt"] == "y"
    # The permissions any file gets here (the umask's), not the 0600 of a temporary file.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(first.stat().st_mode) == 0o666 & ~umask


def test_no_clobber_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File systems without hard links (FAT, some network mounts) reserve the name instead."""

    def no_links(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    (tmp_path / "a.png").write_bytes(b"earlier")
    written = cli_files.save_png(Image.new("RGB", (8, 8)), tmp_path / "a.png", {})
    assert written.name == "a-1.png" and (tmp_path / "a.png").read_bytes() == b"earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1.png", "a.png"]


def test_each_written_file_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    argv = ["--prompt", "a fox", "--prompt", "a cat", "--out", str(out), "--resolution", "64x64", "--steps", "2"]
    with caplog.at_level(logging.INFO, logger="bcg-generate"):
        assert main(argv) == 0
    files = sorted(out.iterdir())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote ")]
    assert said == [f"wrote {p}" for p in files] and len(files) == 2
    assert "2 image(s) to make: 2 prompt(s) x 1 resolution(s) x 1 in calls of 1" in caplog.text
    assert capsys.readouterr().out.rstrip().endswith(f"wrote 2 file(s) to {out}{os.sep}")


def test_a_name_that_is_not_utf8_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder name of bytes that are not UTF-8 reaches Python as surrogates, which a strict
    stdout cannot print: the summary shows their escapes instead of failing after the image."""
    out = tmp_path / "caf\udce9.png"
    assert main(["--out", str(out), *FAST]) == 0
    assert out.exists()
    assert capsys.readouterr().out.rstrip().endswith("caf\\udce9.png")


def test_encode_image_and_save_png_keep_every_pixel_and_the_text(tmp_path: Path) -> None:
    """The run-length zlib strategy the PNGs are written with is lossless, in memory and on disk."""
    import io

    import numpy as np

    rng = np.random.default_rng(3)
    ramp = np.linspace(0, 255, 96, dtype=np.float64)
    pixels = (np.stack([np.add.outer(ramp, ramp) / 2] * 3, -1) + rng.integers(0, 24, (96, 96, 3))).astype(np.uint8)
    image = Image.fromarray(pixels)
    text = {"prompt": "a lighthouse", "seed": "7"}
    for read in (
        Image.open(io.BytesIO(encode_image(image, text, "png"))),
        Image.open(cli_files.save_png(image, tmp_path / "a.png", text)),
    ):
        assert np.array_equal(np.asarray(read), pixels)
        assert {k: read.text[k] for k in text} == text
