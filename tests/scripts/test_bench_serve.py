"""scripts/bench_serve.py at its smallest on the CPU: the loop, the batched and the unbatched
server runs, the table and the JSON it writes (speed is reported, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.ranks import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_serve


def test_a_tiny_run_writes_every_variant(tmp_path: Path, few_threads: None) -> None:
    out = tmp_path / "serve"
    argv = ["--resolution", "32", "--steps", "1", "--requests", "8", "--clients", "1", "4", "--repeats", "1"]
    assert bench_serve.main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads((out / "serve.json").read_text())
    rows = {(r["variant"], r["clients"]): r for r in result["rows"]}
    assert sorted(rows) == [("batched", 1), ("batched", 4), ("loop", 1), ("unbatched", 1), ("unbatched", 4)]
    for r in rows.values():
        assert r["requests"] == 8 and r["images_per_s"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"]
    assert rows[("unbatched", 4)]["requests_per_call"] == 1.0  # --max-batch 1: never joined
    assert 1.0 <= rows[("batched", 4)]["requests_per_call"] <= 4.0
    assert result["settings"]["resolution"] == "32x32" and result["env"]["torch"]
    table = (out / "serve.md").read_text()
    assert "| batched | 4 |" in table and "batched / unbatched images/s: 1 client(s)" in table
