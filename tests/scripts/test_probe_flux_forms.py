"""scripts/probe_flux_forms.py on the tiny FLUX.1 on the CPU: every variant runs, its model is
given back as it was (fused projections undone, the decoder's forward stock), and each variant's
output equals the same variant with its runners off. Nothing compiles on a CPU; the GPU numbers
come from running the script on the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "probe_flux_forms.py"


def test_every_variant_runs_and_equals_itself_without_graphs(tmp_path: Path) -> None:
    every = "eager,compiled,compiled-stock-single,compiled-stock-norms,compiled+vae,fused-qkv,fused-qkv+vae"
    cmd = [sys.executable, str(SCRIPT), "--size", "tiny", "--repeats", "1", "--variants", every, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"probe_flux_forms.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "flux-forms.json").read_text())
    variants = result["variants"]
    assert list(variants) == every.split(",")
    for label, row in variants.items():
        assert "error" not in row, f"{label}: {row['error']}"
        assert row["median_s"] > 0 and len(row["seconds"]) == 1
    for label in every.split(",")[1:]:
        assert variants[label]["equal_to_compiled_eager"] is True, label
        assert variants[label]["given_back"] is True, f"{label}: the pipeline was not given back as it was"
    # On a CPU nothing compiles and the fused projections compute what the three did.
    assert variants["fused-qkv"]["max_abs_diff_to_stock_eager"] < 1e-4
