"""scripts/bench_fp8.py on the CPU (a tiny model, the stand-in quantizer): every row runs, in the
order quantizing allows, and its outputs have the promised shape. Speed is never asserted here;
the GPU numbers come from running the script on the device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers.fake_quant import use_grid

ROOT = Path(__file__).resolve().parents[2]


def test_the_fp8_bench_runs_every_row_and_writes_its_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_fp8_script", ROOT / "scripts" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # puts scripts/ on sys.path
    from benchkit.fp8_run import VARIANTS

    use_grid(monkeypatch, levels=32)
    out = tmp_path / "fp8"
    argv = ["--only", "z-image", "--size", "tiny", "--steps", "2", "--resolution", "32", "--runs", "1"]
    variants = [v for v in VARIANTS if v != "bf16-graphs"]
    bench.main([*argv, "--variants", *variants, "--out", str(out)])

    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert [r["variant"] for r in rows] == variants
    assert all(r["status"] == "ok" for r in rows), [r.get("reason") for r in rows]
    eager, compiled, fa3, fp8, fp8_fa3, cached = rows
    assert eager["latents"] == {"max_abs": 0.0, "rel_l2": 0.0} and eager["image"]["psnr_db"] == float("inf")
    assert compiled["latents"]["max_abs"] == 0.0 and compiled["vs_no_graphs"] == 0.0  # on the CPU: eager
    assert fp8["latents"]["rel_l2"] > 0 and fp8["image"]["max_abs"] > 0 and fp8["vs_no_graphs"] == 0.0
    sel = fp8["selection"]
    assert sel["kept_by_recipe"] == 9 and sel["calibration_error"] <= result["args"]["fp8_budget"]
    assert sel["quantized"] + sel["kept_by_recipe"] + len(sel["kept_measured"]) == 37
    assert fp8["quantize"].startswith("fp8 (stand-in grid): ")
    # No fa3-fwd wheel here: the rows say so in one line and run the attention as before.
    assert fa3["attention"].startswith("attention fa3: not used (the fa3-fwd wheel is not installed")
    assert fa3["latents"] == compiled["latents"]
    assert "by an earlier" not in fp8_fa3["quantize"] and fp8_fa3["selection"] == fp8["selection"]
    assert "by an earlier quantize='fp8'" in cached["quantize"]  # the float8 layers stayed; not measured again
    assert cached["latents"] == fp8["latents"]  # tiny runs no cached step within 2 steps
    for key in ("torch", "diffusers", "torchao", "device_name", "git_commit"):
        assert key in result["env"]
    md = (out / "results.md").read_text()
    assert md.count("\n| z-image | ") == 6 and "| fp8-compiled-graphs | 32x32 |" in md


def test_cold_rows_each_start_from_a_fresh_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cold``: every compiled row builds the model again (dynamo reset, an empty inductor
    cache), so the float8 + DBCache row measures and compiles as the float8 row did, and their
    setup seconds compare."""
    spec = importlib.util.spec_from_file_location("bench_fp8_script", ROOT / "scripts" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from benchkit import fp8_bench

    built: list[int] = []
    build = fp8_bench.Bench.build
    monkeypatch.setattr(fp8_bench.Bench, "build", lambda self: built.append(1) or build(self))
    use_grid(monkeypatch, levels=32)
    out = tmp_path / "cold"
    variants = ["bf16-eager", "fp8-compiled-graphs", "fp8-dbcache-compiled-graphs"]
    argv = ["--only", "z-image", "--size", "tiny", "--steps", "2", "--resolution", "32", "--runs", "1", "--cold"]
    bench.main([*argv, "--variants", *variants, "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["rows"]
    # Built once for bf16 eager and the float8 row after it (eager changes nothing), once more for DBCache.
    assert [r["status"] for r in rows] == ["ok"] * 3 and len(built) == 2
    fp8, cached = rows[1:]
    assert cached["quantize"].startswith("fp8 (stand-in grid): ") and cached["selection"] == fp8["selection"]
    for r in (fp8, cached):
        assert {"compiled_graphs", "capture_passes", "recompile_drops"} <= set(r)


def test_the_fa3_rows_run_flashattention3_and_measure_its_float8_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the wheel (its stand-in, computing on the CPU): the bf16 row's attention is
    FlashAttention-3, the float8 row measures the attention layers with the Linear ones."""
    from tests.helpers.fake_fa3 import use_fake_fa3

    spec = importlib.util.spec_from_file_location("bench_fp8_script", ROOT / "scripts" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    use_fake_fa3(monkeypatch)
    use_grid(monkeypatch, levels=32)
    out = tmp_path / "fa3"
    variants = ["bf16-eager", "bf16-fa3-compiled-graphs", "fp8-fa3-compiled-graphs"]
    argv = ["--only", "z-image", "--size", "tiny", "--steps", "2", "--resolution", "32", "--runs", "1"]
    bench.main([*argv, "--variants", *variants, "--fp8-budget", "1.0", "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 3, [r.get("reason") for r in rows]
    _, fa3, fp8 = rows
    assert fa3["attention"].startswith("attention fa3: FlashAttention-3 (fa3-fwd), bf16")
    assert 0 < fa3["latents"]["rel_l2"] < 0.05  # exact attention, other sums (and bf16 here)
    assert fp8["selection"]["attention_fp8"] == 4 and fp8["selection"]["attention_kept"] == []
    assert "attention 4 / 0" in (out / "results.md").read_text()


def test_a_flipped_form_runs_the_first_backends_rows_again_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--form-flip fused_head_norms``: after the float8 rows, the same rows on a fresh model with
    the recipe's flag the other way (off: the form is on by default), and the flag put back."""
    spec = importlib.util.spec_from_file_location("bench_fp8_script", ROOT / "scripts" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from benchkit import fp8_bench

    from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe

    flags: list[bool] = []
    run = fp8_bench.Bench.run
    monkeypatch.setattr(
        fp8_bench.Bench, "run", lambda self, v, b: flags.append(QwenImage21Recipe.fused_head_norms) or run(self, v, b)
    )
    use_grid(monkeypatch, levels=32)
    out = tmp_path / "flip"
    argv = ["--only", "qwen-image-2.1", "--size", "tiny", "--steps", "2", "--resolution", "64", "--runs", "1"]
    bench.main([*argv, "--variants", "bf16-eager", "fp8-compiled-graphs", "--form-flip", "fused_head_norms",
                "--out", str(out)])  # fmt: skip
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "bf16-eager",
        "fp8-compiled-graphs",
        "fp8-compiled-graphs[default, fused_head_norms off]",
    ]
    assert all(r["status"] == "ok" for r in rows), [r.get("reason") for r in rows]
    assert flags == [True, True, False] and QwenImage21Recipe.fused_head_norms is True
    with pytest.raises(SystemExit, match="no form flag made_up"):
        bench.main([*argv, "--variants", "fp8-compiled-graphs", "--form-flip", "made_up", "--out", str(out)])


def test_a_rebuilt_model_finds_the_one_before_it_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float8 FA3 row after another float8 row builds the model again inside the rows' loop:
    nothing of the bench may still hold the first model then (on a GPU two full-size models and a
    compiled one's graphs do not fit)."""
    import gc
    import weakref

    spec = importlib.util.spec_from_file_location("bench_fp8_script", ROOT / "scripts" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from benchkit import fp8_bench

    held: list[bool] = []
    build = fp8_bench.Bench.build

    def checked(self: fp8_bench.Bench) -> None:
        before = weakref.ref(self.pipe.transformer) if self.pipe is not None else None
        build(self)
        gc.collect()
        if before is not None:
            held.append(before() is not None)

    monkeypatch.setattr(fp8_bench.Bench, "build", checked)
    use_grid(monkeypatch, levels=32)
    out = tmp_path / "rebuilt"
    argv = ["--only", "qwen-image-2.1", "--size", "tiny", "--steps", "2", "--resolution", "64", "--runs", "1"]
    bench.main([*argv, "--variants", "bf16-eager", "fp8-compiled-graphs", "fp8-fa3-compiled-graphs", "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 3, [r.get("reason") for r in rows]
    assert held == [False]
