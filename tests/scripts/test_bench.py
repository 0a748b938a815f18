"""scripts/bench.py in --smoke mode (tiny models on CPU): it runs end to end and its outputs have the
promised shape. Speed itself is never asserted here; the GPU numbers come from running the script
on the device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench.py"
MODELS = ("z-image", "qwen-image")
RESOLUTIONS = ("64x64", "96x64")
VARIANTS = (
    "eager",
    "bcg",
    "bcg-exact",
    "graph",
    "compile",
    "compile-ro",
    "compile-regional",
    "bcg+compile",
    "bcg+compile-tuned",
    "bcg+compile-stock",
)
ENV_KEYS = ("device", "device_name", "driver", "cuda", "torch", "diffusers", "transformers", "python")
NUMBERS = (
    "step_ms",
    "host_ms",
    "step_min_ms",
    "seq_ms",
    "speedup_vs_eager",
    "capture_s",
    "compile_s",
    "e2e_s",
    "e2e_per_step_ms",
    "e2e_speedup_vs_eager",
)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"bench.py --smoke failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads((out / "results.json").read_text())
    return out, results, proc.stdout


def test_env_and_config(smoke) -> None:
    _, results, _ = smoke
    env = results["env"]
    for key in ENV_KEYS:
        assert key in env, f"env lacks {key}"
    assert env["device"] == "cpu" and env["torch"] and env["diffusers"] and env["python"]
    config = results["config"]
    assert config["compile_cache"] is None and config["compile_cache_state"] == "cold"  # a fresh folder
    assert config["smoke"] is True and config["size"] == "tiny" and config["device"] == "cpu"
    assert tuple(config["resolutions"]) == RESOLUTIONS
    assert tuple(config["variants"]) == VARIANTS


def test_every_variant_has_one_entry_per_model_and_resolution(smoke) -> None:
    _, results, _ = smoke
    cases = results["cases"]
    keys = [(c["model"], c["resolution"], c["variant"]) for c in cases]
    assert len(keys) == len(set(keys)), "duplicate entries"
    assert set(keys) == {(m, r, v) for m in MODELS for r in RESOLUTIONS for v in VARIANTS}
    for c in cases:
        where = f"{c['model']} {c['resolution']} {c['variant']}"
        assert c["status"] in ("ok", "skipped", "error"), where
        if c["status"] != "ok":
            assert isinstance(c["reason"], str) and c["reason"].strip(), f"{where}: no reason"
            continue
        assert c["step_ms"] > 0 and c["host_ms"] > 0, where
        for key in NUMBERS:
            value = c.get(key)
            if value is not None:
                assert isinstance(value, (int, float)) and math.isfinite(value), f"{where}: {key}={value}"
                # Without CUDA the warm-up captures nothing and can round to 0 s; nothing is negative.
                assert value > 0 or (key in ("capture_s", "compile_s") and value == 0), f"{where}: {key}={value}"


def test_eager_and_bcg_ran_and_cuda_variants_say_why_not(smoke) -> None:
    _, results, _ = smoke
    by = {(c["model"], c["resolution"], c["variant"]): c for c in results["cases"]}
    for m in MODELS:
        for r in RESOLUTIONS:
            for v in ("eager", "bcg", "bcg-exact"):
                assert by[(m, r, v)]["status"] == "ok", f"{m} {r} {v}: {by[(m, r, v)]['reason']}"
            assert by[(m, r, "bcg")]["speedup_vs_eager"] > 0
            # On a CPU the runner runs the stock forward: the same numbers as eager.
            assert by[(m, r, "bcg")]["out_max_abs_diff"] == 0.0
            for v in ("graph", "compile-ro"):
                assert by[(m, r, v)]["status"] == "skipped" and "CUDA" in by[(m, r, v)]["reason"]
            for v in ("compile", "compile-regional"):
                assert by[(m, r, v)]["status"] == "skipped" and "smoke" in by[(m, r, v)]["reason"]
            assert by[(m, r, "bcg+compile")]["status"] == "skipped" and "CUDA" in by[(m, r, "bcg+compile")]["reason"]
            stock = by[(m, r, "bcg+compile-stock")]
            assert stock["status"] == "skipped" and "CUDA" in stock["reason"]
            tuned = by[(m, r, "bcg+compile-tuned")]
            assert tuned["status"] == "skipped" and "--inductor" in tuned["reason"]


def test_end_to_end_and_memory_series(smoke) -> None:
    _, results, _ = smoke
    by = {(c["model"], c["resolution"], c["variant"]): c for c in results["cases"]}
    for m in MODELS:
        eager, bcg = by[(m, RESOLUTIONS[0], "eager")], by[(m, RESOLUTIONS[0], "bcg")]
        assert eager["e2e_s"] > 0 and bcg["e2e_s"] > 0 and bcg["e2e_speedup_vs_eager"] > 0
        assert bcg["e2e_bit_equal"] is True  # no graphs on a CPU: bit for bit the stock pipeline
        assert bcg["e2e_steps"] == (9 if m == "z-image" else 2)
        assert by[(m, RESOLUTIONS[1], "eager")]["e2e_s"] is None  # smoke: end to end at the first size only
        series = [s for s in results["memory_series"] if s["model"] == m]
        assert [s["n_resolutions"] for s in series] == [1, 2]
        assert all(s["graph_mb"] == 0 for s in series)  # no CUDA, no graphs


def test_markdown_and_plots(smoke) -> None:
    out, results, stdout = smoke
    md = (out / "results.md").read_text()
    assert "Device:" in md and "torch" in md and "## z-image" in md and "## qwen-image" in md
    assert "| 64x64 |" in md and "skipped" in md
    assert "64x64 eager" in stdout  # progress lines
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # CI installs only the test extra; the script says why it drew nothing
        assert all(s.startswith("skipped") for s in results["plots"].values())
        return
    for name in ("step_time.png", "graph_memory.png"):
        assert results["plots"][name] == "ok"
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", name


def test_resolution_parsing() -> None:
    bench = _load_bench()
    assert bench.parse_resolution("512") == (512, 512)
    assert bench.parse_resolution("768x512") == (768, 512)  # width x height
    for bad in ("100", "64x", "abc", "0"):
        with pytest.raises(Exception):  # noqa: B017
            bench.parse_resolution(bad)
    args = bench.resolve_config(bench.build_parser().parse_args(["--out", "x", "--device", "cpu"]))
    assert args.size == "tiny" and args.variants == ["eager", "bcg"] and args.dtype == "fp32"


def _write(folder: Path, results: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def _split(results: dict, resolutions: tuple[str, ...]) -> dict:
    part = json.loads(json.dumps(results))
    part["cases"] = [c for c in part["cases"] if c["resolution"] in resolutions]
    part["config"]["resolutions"] = list(resolutions)
    part["memory_series"] = []
    return part


def test_merge_joins_runs_made_in_separate_processes(smoke, tmp_path) -> None:
    _, results, _ = smoke
    bench = _load_bench()
    a = _write(tmp_path / "a", _split(results, RESOLUTIONS[1:]))
    b = _write(tmp_path / "b", _split(results, RESOLUTIONS[:1]))
    out = tmp_path / "merged"
    assert bench.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    key = lambda c: (c["model"], c["resolution"], c["variant"])  # noqa: E731
    assert sorted(map(key, merged["cases"])) == sorted(map(key, results["cases"]))
    # Sorted by model, then area: the run that measured 64x64 came second but is listed first.
    first = [c for c in merged["cases"] if c["model"] == MODELS[0]]
    assert first[0]["resolution"] == RESOLUTIONS[0] and first[0]["run"] == 1
    assert {c["run"] for c in merged["cases"] if c["resolution"] == RESOLUTIONS[1]} == {0}
    assert merged["config"]["resolutions"] == list(RESOLUTIONS)
    assert len(merged["runs"]) == 2
    md = (out / "results.md").read_text()
    assert "Merged from 2 runs" in md and "| 64x64 |" in md and "| 96x64 |" in md
    # The end-to-end breakdown travels with its rows, and its table with them.
    breakdowns = {key(c): c["e2e_breakdown"] for c in results["cases"] if "e2e_breakdown" in c}
    assert breakdowns and {key(c): c["e2e_breakdown"] for c in merged["cases"] if "e2e_breakdown" in c} == breakdowns
    assert md.count("### Where a pipeline call spends its time") == len(MODELS)


def test_merge_refuses_ratios_across_processes_or_machines(smoke, tmp_path) -> None:
    _, results, _ = smoke
    bench = _load_bench()
    a = _write(tmp_path / "a", _split(results, RESOLUTIONS))
    b = _write(tmp_path / "b", _split(results, RESOLUTIONS[:1]))
    with pytest.raises(SystemExit, match="measured in run 0 and in run 1"):
        bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m1")])
    other = _split(results, RESOLUTIONS[1:])
    other["env"]["torch"] = "0.0.0"
    c = _write(tmp_path / "c", other)
    d = _write(tmp_path / "d", _split(results, RESOLUTIONS[:1]))
    with pytest.raises(SystemExit, match="torch"):
        bench.main(["--merge", str(d), str(c), "--out", str(tmp_path / "m2")])
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()


def test_rows_keep_the_results_json_format() -> None:
    """Typed rows write exactly the keys, in the order, of the dict rows they replaced."""
    _load_bench()
    from benchkit.rows import CaseRow, SeriesPoint

    for path in (ROOT / "samples" / "bench" / "results.json", ROOT / "samples" / "bench" / "compile" / "results.json"):
        results = json.loads(path.read_text())
        for case in results["cases"]:
            assert json.dumps(CaseRow.from_dict(case).to_dict()) == json.dumps(case)
        for point in results["memory_series"]:
            assert SeriesPoint.from_dict(point).to_dict() == point
    row = CaseRow.new("z-image", (96, 64), "bcg")
    assert list(row.to_dict())[:5] == ["model", "resolution", "width", "height", "variant"]
    assert len(row.to_dict()) == CaseRow.ALWAYS and "captures" not in row.to_dict()


def test_variants_come_from_the_registry() -> None:
    _load_bench()
    from benchkit.registry import REGISTRY

    assert tuple(REGISTRY) == VARIANTS and all(callable(f) for f in REGISTRY.values())


def test_compile_cache_state(tmp_path, monkeypatch) -> None:
    bench = _load_bench()
    from benchkit.cli import setup_compile_cache

    for name in (
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "BCG_COMPILE_CACHE",
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
    ):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    folder = tmp_path / "cache"
    args = bench.build_parser().parse_args(["--out", "x", "--compile-cache", str(folder)])
    cold = setup_compile_cache(args)
    assert cold.state == "cold" and not cold.temporary and folder.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.environ["BCG_COMPILE_CACHE"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(folder))
    (folder / "fxgraph").mkdir()
    assert setup_compile_cache(args).state == "warm"
    with pytest.raises(SystemExit, match="exclude"):
        bench.resolve_config(
            bench.build_parser().parse_args(
                ["--out", "x", "--device", "cpu", "--compile-cache", str(folder), "--no-compile-cache"]
            )
        )


def _with_compile_rows(results: dict, state: str, scale: float) -> dict:
    """The smoke results as if compile-regional and bcg+compile had run, with a compile cache ``state``."""
    part = _split(results, RESOLUTIONS)
    part["config"]["compile_cache_state"] = state
    part["memory_series"] = results["memory_series"]
    for c in part["cases"]:
        if c["variant"] == "compile-regional":
            c.update(status="ok", reason=None, step_ms=1.0, host_ms=1.0, speedup_vs_eager=2.0, compile_s=10.0 * scale)
        elif c["variant"] == "bcg+compile":
            c.update(
                status="ok",
                reason=None,
                step_ms=0.5,
                host_ms=0.1,
                speedup_vs_eager=4.0,
                compile_s=20.0 * scale,
                capture_s=0.25,
                out_max_abs_diff=0.0,
                out_max_abs_diff_vs_regional=0.0,
            )
    return part


def test_merge_joins_a_cold_and_a_warm_run_of_the_same_cases(smoke, tmp_path) -> None:
    _, results, _ = smoke
    bench = _load_bench()
    warm = _write(tmp_path / "warm", _with_compile_rows(results, "warm", 0.1))
    cold = _write(tmp_path / "cold", _with_compile_rows(results, "cold", 1.0))
    out = tmp_path / "merged"
    assert bench.main(["--merge", str(warm), str(cold), "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    assert len(merged["cases"]) == 2 * len(results["cases"])  # both runs kept
    assert [r["compile_cache"] for r in merged["runs"]] == ["warm", "cold"]
    assert merged["config"]["compile_cache_state"] == "mixed"
    # One memory series per model: the warm repeat adds setup seconds, not a second series.
    assert len(merged["memory_series"]) == len(results["memory_series"])
    md = (out / "results.md").read_text()
    assert "compile-regional first call, cold | compile-regional first call, warm" in md
    assert "bcg+compile compile, cold | bcg+compile compile, warm" in md
    assert "| 10.0 | 1.0 |" in md and "| 20.0 | 2.0 |" in md  # cold beside warm
    assert "### Regional compile, without and with graphs" in md
    # The main tables show the cold run (run 1), every ratio from inside it.
    step_rows = [line for line in md.splitlines() if line.startswith("| 64x64 | ") and "skipped" in line]
    assert len(step_rows) == len(MODELS)
    assert "compile cache warm" in md and "compile cache cold" in md


def test_merge_refuses_two_runs_of_the_same_cases_in_one_cache_state(smoke, tmp_path) -> None:
    _, results, _ = smoke
    bench = _load_bench()
    a = _write(tmp_path / "a", _with_compile_rows(results, "cold", 1.0))
    b = _write(tmp_path / "b", _with_compile_rows(results, "cold", 1.0))
    with pytest.raises(SystemExit, match="measured in run 0 and in run 1, both with a cold compile cache"):
        bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m1")])
    unknown = _with_compile_rows(results, "warm", 0.1)
    del unknown["config"]["compile_cache_state"]  # a run from before the state was recorded
    c = _write(tmp_path / "c", unknown)
    with pytest.raises(SystemExit, match="measured in run 0 and in run 1"):
        bench.main(["--merge", str(a), str(c), "--out", str(tmp_path / "m2")])


# Where one end-to-end call spends its time (--breakdown, on wherever end to end runs).
PHASES = ("text_encoder", "prompt_rest", "denoiser", "loop_rest", "vae_decode", "postprocess", "other")


def test_end_to_end_breakdown(smoke) -> None:
    _load_bench()
    from benchkit.rows import CaseRow

    out, results, stdout = smoke
    assert results["config"]["breakdown"] is True
    by = {(c["model"], c["resolution"], c["variant"]): c for c in results["cases"]}
    for (m, v), row in {(m, v): by[(m, RESOLUTIONS[0], v)] for m in MODELS for v in ("eager", "bcg")}.items():
        b, where = row["e2e_breakdown"], f"{m} {v}"
        assert b["clock"] == "host clock" and b["loop"] == "progress bar" and not b["notes"], where
        assert tuple(b["phases"]) == PHASES, where
        for name, phase in b["phases"].items():
            assert phase["ms"] >= 0 and 0 <= phase["share"] <= 1, f"{where} {name}: {phase}"
        total = sum(phase["ms"] for phase in b["phases"].values())
        assert total == pytest.approx(b["call_ms"], abs=0.01), where  # other is the remainder
        assert abs(total - b["wall_ms"]) <= 0.1 * b["wall_ms"], f"{where}: phases {total} vs call {b['wall_ms']}"
        assert b["outside_denoiser_ms"] == pytest.approx(b["call_ms"] - b["phases"]["denoiser"]["ms"], abs=0.01)
        calls = {name: phase["calls"] for name, phase in b["phases"].items()}
        assert calls["text_encoder"] == (2 if m == "qwen-image" else 1), where  # true CFG encodes twice
        assert calls["denoiser"] == row["e2e_steps"] * row["e2e_calls_per_step"], where
        assert calls["vae_decode"] == calls["postprocess"] == 1, where
        assert all(p["ms"] > 0 for n, p in b["phases"].items() if calls[n]), where
        assert json.dumps(CaseRow.from_dict(row).to_dict()) == json.dumps(row), where  # typed round trip
    for m in MODELS:  # no end to end at the second resolution, so no breakdown either
        assert "e2e_breakdown" not in by[(m, RESOLUTIONS[1], "eager")]
    md = (out / "results.md").read_text()
    assert md.count("### Where a pipeline call spends its time") == len(MODELS)
    assert "| 64x64 | eager |" in md and "outside the denoiser ms" in md and "eager breakdown: call" in stdout


def _snapshot(pipe) -> dict:
    """What the phase hooks touch, read without benchkit's help."""
    state = {}
    for name in ("text_encoder", "transformer"):
        module = getattr(pipe, name)
        state[name] = (list(module._forward_pre_hooks), list(module._forward_hooks), module.__dict__.get("forward"))
    for owner, attr in ((pipe, "encode_prompt"), (pipe, "progress_bar"), (pipe.vae, "decode")):
        state[attr] = (attr in owner.__dict__, getattr(owner, attr).__func__)
    state["postprocess"] = ("postprocess" in pipe.image_processor.__dict__, pipe.image_processor.postprocess.__func__)
    return state


@pytest.mark.parametrize("model", MODELS)
def test_phase_hooks_are_removed_afterwards(model) -> None:
    """After a measured call, and after one that fails, the pipeline's methods and its modules'
    forwards and hook dicts are the originals: on the stock pipeline and on an accelerated one."""
    _load_bench()
    import torch
    from benchkit.calls import accelerate, register_recipes
    from benchkit.phases import hook_state, measure_breakdown
    from benchkit.settings import pipe_kwargs

    from pipelines.builders import build_pipeline

    register_recipes()
    pipe = build_pipeline(model, size="tiny", device="cpu", dtype=torch.float32, seed=0)
    pipe.set_progress_bar_config(disable=True)
    kwargs = pipe_kwargs(model, (64, 64), argparse.Namespace(steps_e2e=2))
    stock = _snapshot(pipe)
    assert stock["postprocess"] == (False, type(pipe.image_processor).postprocess)

    call = lambda: pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="pil")  # noqa: E731
    failing = lambda: pipe(**kwargs, callback_on_step_end=lambda *_: 1 / 0)  # noqa: E731  # fails in the loop
    with torch.no_grad():
        for accelerated in (False, True):
            if accelerated:
                accelerate(pipe)
            before, state = _snapshot(pipe), hook_state(pipe)
            b = measure_breakdown(pipe, call, torch.device("cpu"))
            assert b.phases["denoiser"].calls and b.phases["text_encoder"].calls
            assert _snapshot(pipe) == before and hook_state(pipe) == state
            with pytest.raises(ZeroDivisionError):
                measure_breakdown(pipe, failing, torch.device("cpu"))
            assert _snapshot(pipe) == before and hook_state(pipe) == state
        pipe.accel.restore()
    assert _snapshot(pipe) == stock
