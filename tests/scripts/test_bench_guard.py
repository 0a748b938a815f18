"""scripts/bench_guard.py on tiny models: the rows and files it writes. The numbers themselves are
measured on the full-size transformers (docs/benchmarks.md); this only checks the script runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_guard  # noqa: E402
from benchkit.guard_timing import PARTS  # noqa: E402


def test_bench_guard_on_tiny_models_writes_every_part_for_both(tmp_path: Path, capsys) -> None:
    assert bench_guard.main(["--size", "tiny", "--calls", "12", "--warmup", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "guard.json").read_text())
    assert data["env"]["torch"] == torch.__version__ and data["env"]["device_name"]
    rows = {r["model"]: r for r in data["rows"]}
    assert set(rows) == {"qwen-image", "z-image"}
    for row in rows.values():
        assert row["watched_dicts"] > row["modules"] > 10 and row["tensors"] > 10
        for part in (*PARTS, "look"):
            assert row[f"{part}_ms"] > 0
    table = (tmp_path / "guard.md").read_text()
    assert table.count("| qwen-image (tiny) |") == 1 and "follow()" in table
    assert "qwen-image (tiny)" in capsys.readouterr().out
