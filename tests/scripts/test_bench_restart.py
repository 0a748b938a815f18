"""scripts/bench_restart.py on a CPU: two processes with one compile cache folder, tiny Z-Image.

Nothing compiles on a CPU (``compile=True`` needs CUDA) and no graph is captured, so this checks the
measurement itself: two processes run, each with every persistent cache pointed at the folder, and
restart.json and restart.md say what they measured (and that the numbers need a GPU). The ratio's
arithmetic and notes are checked on synthetic results.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_restart.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_restart_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def restart(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    argv = [sys.executable, str(SCRIPT), "--model", "z-image", "--size", "tiny", "--resolutions", "64x64", "32x32"]
    proc = subprocess.run([*argv, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bench_restart.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, json.loads((out / "restart.json").read_text()), (out / "restart.md").read_text()


def test_two_processes_share_one_cache_folder(restart) -> None:
    out, result, md = restart
    folder = str((out / "compile-cache").resolve())
    for which in ("cold", "warm"):
        d = result[which]
        assert d["cache_env"] == {
            "TORCHINDUCTOR_CACHE_DIR": folder,
            "TRITON_CACHE_DIR": str(Path(folder) / "triton"),
            "BCG_COMPILE_CACHE": folder,
        }
        assert d["resolutions"] == ["64x64", "32x32"] and d["process_s"] > d["imported_s"] > 0
        assert {"warmup_s", "compile_s", "capture_s", "counters", "rows"} <= set(d)
        assert (out / f"{which}.log").exists()
    s = result["summary"]
    assert s["bar"] == 0.5 and s["met"] is None  # nothing compiled on a CPU: no verdict
    assert any("nothing was compiled" in n for n in s["notes"])
    assert "# Warm-up after a restart: z-image, 2 resolutions, compile=True" in md
    assert "| first (cold) |" in md and "| second (warm) |" in md and "not measured" in md


def test_a_cache_folder_that_is_not_empty_is_refused(tmp_path, capsys) -> None:
    script = _load()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "left").write_text("x")
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", "z-image", "--size", "tiny", "--out", str(tmp_path / "o"), "--cache", str(cache)])
    assert exc.value.code == 2 and "is not empty: the first process must start cold" in capsys.readouterr().err


def _process(warmup: float, compile_s: float, graphs: int = 4, misses: int = 0) -> dict:
    counters = {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": misses, "autograd_cache_hit": 0, "autograd_cache_miss": 0}
    return {
        "warmup_s": warmup,
        "compile_s": compile_s,
        "process_s": warmup + 60,
        "compiled_graphs": graphs,
        "skipped": None,
        "counters": counters,
    }


def test_the_ratio_and_its_verdict() -> None:
    script = _load()
    s = script.summary(_process(45.0, 20.0), _process(21.0, 4.0))
    assert s["warmup_ratio"] == pytest.approx(21 / 45, abs=1e-3) and s["met"] is True and not s["notes"]
    assert s["compile_ratio"] == pytest.approx(0.2) and s["process_ratio"] == pytest.approx(81 / 105, abs=1e-3)
    s = script.summary(_process(45.0, 20.0), _process(30.0, 12.0, misses=3))
    assert s["met"] is False and "missed the FX graph cache 3 time(s)" in s["notes"][0]


def test_the_child_environment_points_every_cache_at_the_folder(tmp_path, monkeypatch) -> None:
    script = _load()
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    env = script.child_env(tmp_path)
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES" not in env
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path) and env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert env["BCG_COMPILE_CACHE"] == str(tmp_path) and str(ROOT) in env["PYTHONPATH"].split(":")
