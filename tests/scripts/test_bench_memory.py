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
    # Per call, in order: where the peak rose, beside the decoder's verdict at that size.
    assert "Peak reserved (GiB) after each call" in md and "| z-image | graphs | 64x64 |" in md

    from benchkit.memory_run import _decoder

    from accel.hooks.images.decoder_verdict import Timing, choose

    t = Timing(
        (64, 64, None), "k", 10.0, 5.0, noise_ms=0.2, graph_bytes=3 << 20, replay_bytes=1 << 20, eager_bytes=4 << 20
    )
    choose([t], [], 0)
    said = _decoder(t)
    assert said["verdict"] == "eager: slower" and said["why"] == "the replay was slower than the eager decode"
    assert (said["graph_pool_mib"], said["replay_copies_mib"], said["eager_decode_mib"], said["noise_ms"]) == (
        3,
        1,
        4,
        0.2,
    )
