"""scripts/bench_breadth.py on tiny families on the CPU: each family in its own process, the table and
the JSON with every field, graphs equal to eager (no graphs on a CPU: the stock forward runs), a
family past its timeout recorded as such. Speed is never asserted; the GPU numbers come from
running the script on the device.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_breadth.py"
FAMILIES = ("flux", "wan")  # an image model without CFG, a video model with it
ENV_KEYS = ("device", "device_name", "torch", "diffusers", "transformers", "python", "git_commit")


def _load():
    spec = importlib.util.spec_from_file_location("bench_breadth_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("breadth")
    cmd = [sys.executable, str(SCRIPT), "--size", "tiny", "--only", ",".join(FAMILIES), "--out", str(out)]
    cmd += ["--variants", "eager,graphs,compiled", "--threads", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bench_breadth.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, json.loads((out / "breadth.json").read_text()), proc.stdout


def test_config_env_and_one_row_per_family(run):
    out, results, _ = run
    config = results["config"]
    assert config["size"] == "tiny" and config["device"] == "cpu" and config["steps"] == [2, 4]
    assert config["variants"] == ["eager", "graphs", "compiled"]
    assert list(results["results"]) == list(FAMILIES)
    for name, row in results["results"].items():
        assert row["status"] == "ok", f"{name}: {row.get('reason')}"
        for key in ENV_KEYS:
            assert key in row["env"], f"{name}: env lacks {key}"
        assert row["env"]["device"] == "cpu"
        assert row["params"]["transformer"] > 0 and row["build_s"] >= 0
        assert "text_encoder" in row["absent"] and row["inputs"]["prompt_embeds"]["shape"][0] == 1
        assert (out / "logs" / f"{name}.log").read_text().strip()
    assert results["results"]["wan"]["geometry"]["frames"] == 5 and results["results"]["wan"]["cfg"] is True


def test_eager_fit_and_derived_end_to_end(run):
    _, results, _ = run
    for row in results["results"].values():
        eager = row["variants"]["eager"]
        times = {int(s): t[0] for s, t in eager["times_s"].items()}
        assert set(times) == {2, 4} and all(t > 0 for t in times.values())
        per_step = (times[4] - times[2]) / 2
        assert eager["per_step_ms"] == pytest.approx(per_step * 1e3, abs=0.01)
        assert eager["fixed_ms"] == pytest.approx((times[2] - 2 * per_step) * 1e3, abs=0.01)
        usual = row["usual_steps"]
        assert eager["e2e_s"] == pytest.approx(times[2] + (usual - 2) * per_step, abs=2e-3)
        assert eager["e2e_derived_from_steps"] == [2, 4]


def test_graphs_equal_to_eager_with_counters_and_a_reason(run):
    _, results, _ = run
    for row in results["results"].values():
        graphs = row["variants"]["graphs"]
        assert graphs["status"] == "ok", graphs.get("reason")
        assert graphs["equal"] is True and graphs["max_abs_diff"] == 0.0
        assert graphs["options"] == {} and graphs["denoisers"] == ["transformer"]
        assert "skipped" in graphs["warmup"] and graphs["warmup_covered"] is None  # no warm-up on a CPU
        calls = graphs["timed_calls"]
        per_call = 2 if row["cfg"] else 1
        # One untimed call at 2 steps, then 2 and 4: every denoiser call ran eagerly.
        assert calls["eager_calls"] == per_call * (2 + 2 + 4) and calls["replays"] == 0
        assert graphs["graphs_used"] == "no" and "CUDA" in graphs["why_not"]
        assert graphs["report"].startswith("bcg-diffusers: ")
        compiled = row["variants"]["compiled"]
        assert compiled["status"] == "skipped" and "CUDA" in compiled["reason"]


def test_table(run):
    out, _, stdout = run
    md = (out / "breadth.md").read_text()
    assert "**Device:**" in md and "torch" in md and "diffusers" in md
    assert "| flux (FluxPipeline) | 64x64, 28 steps |" in md
    assert "| wan (WanPipeline) | 64x64x5f, 50 steps, CFG |" in md
    header = next(line for line in md.splitlines() if line.startswith("| pipeline"))
    row = next(line for line in md.splitlines() if line.startswith("| wan "))
    assert header.count("|") == row.count("|")
    assert "no warm-up" in row and "| yes |" in row  # equal, bit for bit
    assert "Compiled variant skipped" in md
    assert "[1/2] flux: starting" in stdout and "wan graphs:" in stdout  # progress lines, the child's too


def test_a_family_past_its_timeout_is_recorded(tmp_path, monkeypatch):
    script = _load()
    monkeypatch.setenv(script.CLOCK_ENV, "0")  # main sets it; restored after the test
    assert script.main(["--size", "tiny", "--only", "sana", "--timeout", "1", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "breadth.json").read_text())["results"]["sana"]
    assert row["status"] == "timeout" and "--timeout 1 s" in row["reason"]
    assert "timeout" in (tmp_path / "breadth.md").read_text()


def test_bad_arguments_are_one_line_and_status_2(tmp_path, capsys):
    script = _load()
    assert script.main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "--only: unknown families nope" in capsys.readouterr().err
    assert script.main(["--variants", "eager,turbo", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        script.main(["--steps", "4", "--out", str(tmp_path)])


def test_why_not_reads_the_report():
    _load()  # puts scripts/ on sys.path
    from benchkit.breadth_variants import _why_not

    report = (
        "bcg-diffusers: X, mode bcg\n"
        "  transformer (T, recipe generic, graphs): 0 graphs, ...\n"
        "    capture failed: RuntimeError: a host sync (at f (m.py:3))\n"
        "  vae.decoder (D, recipe generic, graphs): 0 graphs\n"
        "    no graphs: nothing warmed up yet\n"
    )
    why = "transformer: capture failed: RuntimeError: a host sync (at f (m.py:3))"
    assert _why_not(report, {"transformer": None}) == why
    assert _why_not(report, {"transformer": "a hook it has no rule for"}) == "transformer: a hook it has no rule for"
    kept = "bcg-diffusers: X\n  transformer (T, recipe generic, graphs): 1 graphs\n  vae.decoder (D): 0 graphs\n"
    assert _why_not(kept, {"transformer": None}) == ""
