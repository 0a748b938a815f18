"""scripts/bench_lora_switch.py on the tiny Z-Image with emulated graphs: every variant runs, the
capture counts are what the bars ask (a recapture captures, a hot-swap and a switch back do not),
each image equals a stock pipeline's after the same change, and the files are written. Speed is
never asserted here; the GPU numbers come from running the script on the device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.emulator import emulate_pipelines

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_lora_switch as bench  # noqa: E402
from benchkit.lora_run import VARIANTS  # noqa: E402


def test_lora_switch_bench_counts_captures_and_matches_stock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, few_threads
) -> None:
    emulate_pipelines(monkeypatch)
    argv = ["--models", "z-image", "--size", "tiny", "--resolution", "64", "--steps", "2", "--rank", "4"]
    assert bench.main([*argv, "--repeats", "2", "--out", str(tmp_path)]) == 0

    data = json.loads((tmp_path / "lora.json").read_text())
    (result,) = data["results"]
    assert result["setup"]["graphs"] and result["setup"]["warmup_captures"] > 0
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    assert all(r["status"] == "ok" for r in rows.values()), [r.get("reason") for r in rows.values()]
    assert rows["plain"]["captures"] == [0, 0]
    assert rows["hot-swap"]["captures"] == [0, 0] and rows["hot-swap"]["differs_from_plain"]
    assert rows["switch-back"]["captures"] == [0, 0] and rows["switch-back"]["switch_to_b_captures"] == [0, 0]
    assert all(c > 0 for c in rows["switch-back"]["prelude_captures"])  # a again after b's load, then b's state
    assert all(c > 0 for c in rows["recapture"]["captures"]) and rows["recapture"]["capture_s"] > 0
    assert rows["recapture"]["captures_by_module"] == {"transformer": rows["recapture"]["captures"][0]}
    for r in rows.values():
        assert r["check"] == {"reference": "stock", "exact_expected": True, "equal": True, "max_abs": 0.0}
        assert r["repeats"] == 2 and len(r["samples_s"]) == 2 and r["total_s"] > 0
        assert r["total_s"] == pytest.approx(r["change_s"] + r["call_s"], abs=2e-3)
    assert "cost_s" in rows["hot-swap"] and "cost_s" not in rows["plain"]
    assert all(c["ok"] for c in result["checks"] if c["asserted"]), result["checks"]
    for key in ("torch", "diffusers", "peft", "device_name", "git_commit"):
        assert data["env"][key]
    md = (tmp_path / "lora.md").read_text()
    assert md.count("\n| ") == 1 + len(VARIANTS) and "| hot-swap |" in md and "FAILED" not in md


def test_lora_switch_bench_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--variants", "plain,sideways"], ["--repeats", "0"], ["--models", "flux"], ["--resolution", "60"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main([*bad, "--size", "tiny", "--out", str(tmp_path / "x")])
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_lora_switch_bench_on_qwen_image_against_no_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, few_threads
) -> None:
    """True CFG (two denoiser calls a step), the same pipeline with graphs off as the reference, one
    repeat (the hot-swap gives adapter a its LoRA back), no floor, and a hot-swap after a recapture
    (whose adapter deleted after its call is captured again before the hot-swap is timed)."""
    emulate_pipelines(monkeypatch)
    argv = ["--models", "qwen-image", "--size", "tiny", "--resolution", "64", "--steps", "2", "--rank", "4"]
    argv += ["--variants", "recapture,hot-swap", "--reference", "no-graphs", "--repeats", "1"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0

    (result,) = json.loads((tmp_path / "lora.json").read_text())["results"]
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["recapture", "hot-swap"]
    assert rows["recapture"]["captures"][0] > 0 and "settle_captures" not in rows["recapture"]
    assert rows["hot-swap"]["settle_captures"] > 0 and rows["hot-swap"]["captures"] == [0]
    for r in rows.values():
        assert r["status"] == "ok" and "cost_s" not in r
        assert r["check"] == {"reference": "no-graphs", "exact_expected": True, "equal": True, "max_abs": 0.0}
    assert result["settings"]["steps"] == 2 and result["settings"]["reference"] == "no-graphs"
