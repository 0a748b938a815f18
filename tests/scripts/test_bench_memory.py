"""scripts/bench_memory.py on the CPU (tiny models, no CUDA): every row runs, eager first, and its
outputs have the promised shape. Memory numbers need a GPU; they come from running the script on
the device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_memory_bench_runs_eager_first_then_graphs_and_writes_its_tables(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_memory_script", ROOT / "scripts" / "bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # puts scripts/ on sys.path
    out = tmp_path / "memory"
    bench.main(["--only", "z-image", "--size", "tiny", "--variants", "graphs", "--out", str(out)])

    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["eager", "graphs"]  # eager runs first, asked or not
    assert all(r["status"] == "ok" for r in rows), [r.get("reason") for r in rows]
    eager, graphs = rows
    assert eager["sizes"] == ["64x64", "32x32"] and [c["resolution"] for c in eager["calls"]] == eager["sizes"]
    assert eager["memory"] is None and graphs["memory"] is None  # no CUDA: no memory to read
    assert graphs["warmup"].startswith("nothing captured")  # CPU: the pipeline runs eagerly
    assert "bcg-diffusers: ZImagePipeline" in graphs["report"]
    md = (out / "results.md").read_text()
    assert "| z-image | eager | 64x64 32x32 |" in md and "| z-image | graphs |" in md
