"""The bcg-generate CLI end to end on the tiny built-in model (CPU), its errors, and the split
of work across processes (pure functions, then a real two-process accelerate launch)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from accel.cli import DEFAULT_PROMPT, Job, main, plan_jobs, shard, slug

ROOT = Path(__file__).resolve().parents[1]
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
    assert meta["mode"] == "bcg"
    assert meta["model"] == "z-image"
    assert meta["guidance"] == "0"
    assert meta["Software"].startswith("bcg-diffusers ")
    summary = capsys.readouterr().out
    assert "s/image" in summary and "denoising steps/s" in summary and "graph memory" in summary


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
# Bad input: non-zero, one line on stderr, no traceback
# --------------------------------------------------------------------------------------------
def _bad_cases(tmp: Path) -> dict[str, list[str]]:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    cases = {
        "unknown model": ["--model", "no-such-model"],
        "resolution without x": ["--resolution", "512"],
        "resolution not numbers": ["--resolution", "axb"],
        "zero width": ["--resolution", "0x512"],
        "not a multiple of 16": ["--resolution", "500x512"],
        "unknown device": ["--device", "quantum-computer"],
        "unwritable out": ["--out", str(a_file / "sub")],
        "missing prompts file": ["--prompts-file", str(tmp / "missing.txt")],
        "several images into one png": ["--batch-size", "2", "--out", str(tmp / "one.png")],
        "unknown mode": ["--mode", "turbo"],
        "warmup none and sizes": ["--warmup", "none", "64x64"],
    }
    if not torch.cuda.is_available():
        cases["bcg on cuda without cuda"] = ["--mode", "bcg", "--device", "cuda"]
        cases["debug on cuda without cuda"] = ["--mode", "debug", "--device", "cuda"]
    return cases


BAD_NAMES = [
    "unknown model", "resolution without x", "resolution not numbers", "zero width", "not a multiple of 16",
    "unknown device", "unwritable out", "missing prompts file", "several images into one png", "unknown mode",
    "warmup none and sizes", "bcg on cuda without cuda", "debug on cuda without cuda",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_input_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = _bad_cases(tmp_path)
    if case not in cases:
        pytest.skip("needs a machine without CUDA")
    argv = ["--steps", "2", "--out", str(tmp_path / "out"), "--quiet"]
    if not any(a == "--resolution" for a in cases[case]):
        argv += ["--resolution", "64x64"]
    rc = main([*argv, *cases[case]])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0
    assert len(lines) == 1, err
    assert lines[0].startswith("bcg-generate: error: ")
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_input_messages_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "no-such-model", "--out", str(tmp_path), "--quiet"])
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    main(["--resolution", "500x512", "--out", str(tmp_path), "--quiet"])
    assert "multiples of 16" in capsys.readouterr().err
    if not torch.cuda.is_available():
        main(["--mode", "bcg", "--device", "cuda", "--out", str(tmp_path), "--quiet"])
        assert "no CUDA device" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Splitting work across processes
# --------------------------------------------------------------------------------------------
def _names(jobs: list[Job]) -> list[str]:
    return [name for job in jobs for name in job.filenames]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]  # fmt: skip
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
