"""scripts/profile_step.py on a CPU: tiny models, not compiled. The profiler records CPU ops only
there, so the files must still be written and say that no CUDA kernel was recorded; the GPU side
(reading kernels and step windows out of a profile, the tables of profile.md) is checked on a
synthetic profile. The kernel numbers themselves come from running the script on the device.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "profile_step.py"
TINY = ["--size", "tiny", "--no-compile", "--resolution", "64x64", "--warmup-calls", "0"]


def _load():
    spec = importlib.util.spec_from_file_location("profile_step_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    """The script as a user runs it, from the checkout."""
    out = tmp_path_factory.mktemp("profile")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "z-image", *TINY, "--steps", "2", "--trace", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"profile_step.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, json.loads((out / "profile.json").read_text()), (out / "profile.md").read_text(), proc.stdout


def test_cpu_run_writes_its_files_and_says_no_kernel_was_recorded(zimage) -> None:
    out, result, md, stdout = zimage
    env, cfg, prof = result["env"], result["config"], result["profile"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["diffusers"] and env["date"]
    assert cfg["model"] == "z-image" and cfg["resolution"] == "64x64" and cfg["steps"] == 2
    assert cfg["calls_per_step"] == 1 and cfg["compile"] is False and cfg["graphs"] is True
    assert prof["steps"] == 2 and len(prof["per_step"]) == 2 and all(p["wall_ms"] > 0 for p in prof["per_step"])
    assert result["timing"]["step_ms"] > 0 and prof["step_ms"] > 0
    assert prof["events"] == 0 and prof["kernels"] == {} and prof["busy_ms"] == 0
    assert result["counts"]["cpu_ops"] > 0 and result["counts"]["device_events"] == 0  # CPU ops, no kernels
    assert any("no CUDA kernels were recorded" in n for n in result["notes"])
    assert "no CUDA kernels were recorded" in stdout
    # The header: device, versions, date and commit; the table by kind; no kernel list.
    assert "**Device:**" in md and f"torch {env['torch']}" in md and env["date"] in md
    assert f"bcg-diffusers {env['git_commit']}" in md
    assert "no CUDA kernels were recorded" in md and "No CUDA kernel recorded." in md
    for k in ("gemm", "attention", "norm", "copy", "other", "idle"):
        assert f"| {k} |" in md
    trace = json.loads((out / "trace.json").read_text())
    assert any(str(e.get("name", "")).startswith("profile_step/") for e in trace["traceEvents"])


def test_cpu_run_lists_the_steps_products_its_floor_and_the_call_outside(zimage) -> None:
    _, result, md, _ = zimage
    gemms = result["gemms"]
    assert gemms and all(g["dtype"] == "bf16" and g["tflops_alone"] is None for g in gemms)  # rates on CUDA only
    assert all(g["flop_per_step"] > 0 and g["calls_per_step"] >= 1 for g in gemms)
    f = result["floor"]["bf16"]
    assert f["tflop_per_step"]["bf16"] == pytest.approx(sum(g["flop_per_step"] for g in gemms) / 1e12, abs=1e-6)
    assert f["tflop_per_step"]["fp8"] == 0 and f["floor_ms"][0] <= f["floor_ms"][1]
    out = result["outside"]
    assert out["steps"] == 9 and out["graphs"]["phases"]["denoiser"]["calls"] == 9
    assert out["graphs"]["phases"]["vae_decode"]["calls"] == 1 and out["eager_decoder"]["call_ms"] > 0
    att = result["attention"]
    assert att and all(
        a["dtype"] == "bf16" and a["tflops_alone"] == {"sdpa": None, "fa3": None, "fa3_fp8": None} for a in att
    )
    assert sum(a["layers"] for a in att) >= 4  # tiny Z-Image: 2 layers, a noise and a context refiner
    w = result["work_floor"]["bf16"]
    assert w["attention_tflop_per_step"] == pytest.approx(sum(a["flop_per_step"] for a in att) / 1e12, abs=1e-6)
    assert w["attention_floor_ms"] == 0.0 and w["attention_layers_fp8"] == []  # no rates measured on a CPU
    assert w["floor_ms"][0] == pytest.approx(sum(w["gemm_floor_ms"][d][0] for d in ("fp8", "bf16")), abs=1e-3)
    for title in (
        "## The step's matrix products by shape",
        "## The step's attention by shape",
        "## Floor: bf16",
        "## Floor from the work: bf16",
        "## The call outside the denoiser",
    ):
        assert title in md, title
    assert "| VAE decode |" in md and "| bf16 |" in md


def test_qwen_image_step_is_both_guidance_calls(tmp_path) -> None:
    script = _load()
    p = script.build_parser()
    args = script.resolve(p, p.parse_args(["--model", "qwen-image", *TINY, "--steps", "1", "--out", str(tmp_path)]))
    result = script.run(args)
    assert result["config"]["calls_per_step"] == 2  # true CFG: the conditional and the unconditional call
    assert result["profile"]["steps"] == 1 and result["profile"]["step_ms"] > 0
    script.write(result, tmp_path, args.top)
    assert json.loads((tmp_path / "profile.json").read_text())["config"]["model"] == "qwen-image"
    assert "qwen-image 64x64" in (tmp_path / "profile.md").read_text()


def _spied_run(script, monkeypatch, argv: list[str], out: Path) -> tuple[dict, list, list]:
    """``script.run`` of ``argv``, with what each warm-up was asked for and each variant's recorded step."""
    from accel.hooks.accelerator import PipelineAccelerator

    warmups: list[dict] = []
    steps: list[list] = []
    warmup, setup = PipelineAccelerator.warmup, script.setup

    def spy_warmup(self, resolutions, **kwargs):
        warmups.append(kwargs)
        return warmup(self, resolutions, **kwargs)

    def spy_setup(*args, **kwargs):
        calls, costs = setup(*args, **kwargs)
        steps.append(calls)
        return calls, costs

    monkeypatch.setattr(PipelineAccelerator, "warmup", spy_warmup)
    monkeypatch.setattr(script, "setup", spy_setup)
    p = script.build_parser()
    args = script.resolve(p, p.parse_args([*argv, "--out", str(out)]))
    result = script.run(args)
    script.write(result, out, args.top)
    return result, warmups, steps


def test_batch_2_records_warms_and_reports_a_call_of_two_images(zimage, tmp_path, monkeypatch) -> None:
    script = _load()
    argv = ["--model", "z-image", *TINY, "--steps", "1", "--batch", "2"]
    _, warmups, steps = _spied_run(script, monkeypatch, argv, tmp_path)
    assert [w["batch_sizes"] for w in warmups] == [[2]]  # the warm-up captures at the batch
    ((a, _),) = steps[0]  # Z-Image: one denoiser call a step; its hidden states a list, one latent per image
    assert len(a[0]) == 2 and all(tuple(x.shape) == (16, 1, 8, 8) for x in a[0])
    assert a[1].shape[0] == 2 and len(a[2]) == 2  # a timestep and a caption per image
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["config"]["batch"] == 2 and written["outside"]["batch"] == 2
    timing = written["timing"]
    assert timing["step_ms_per_image"] == pytest.approx(timing["step_ms"] / 2, abs=1e-3)
    assert written["outside"]["graphs"]["phases"]["denoiser"]["calls"] == 9
    # The products by shape: each M (tokens x batch) twice batch 1's, K and N the same.
    ones = sorted((g["m"] * 2, g["k"], g["n"], g["calls_per_step"]) for g in zimage[1]["gemms"])
    assert sorted((g["m"], g["k"], g["n"], g["calls_per_step"]) for g in written["gemms"]) == ones
    floor1, floor2 = zimage[1]["floor"]["bf16"], written["floor"]["bf16"]
    assert floor2["tflop_per_step"]["bf16"] == pytest.approx(2 * floor1["tflop_per_step"]["bf16"], rel=1e-6)
    md = (tmp_path / "profile.md").read_text()
    assert md.startswith("# Per-kernel profile: z-image 64x64, batch 2,") and "; batch 2 (images per" in md
    assert f"{timing['step_ms'] / 2:.2f} per image at batch 2" in md and "One end-to-end call (2 image(s)," in md
    assert "batch 1 (images per" in zimage[2] and "per image at batch 1" in zimage[2]


def test_qwen_image_batch_2_makes_both_guidance_calls_at_batch_2(tmp_path, monkeypatch) -> None:
    script = _load()
    argv = ["--model", "qwen-image", *TINY, "--steps", "1", "--batch", "2", "--no-gemms", "--no-outside"]
    result, warmups, steps = _spied_run(script, monkeypatch, argv, tmp_path)
    assert [w["batch_sizes"] for w in warmups] == [[2]] and warmups[0]["cfg"] is True
    assert len(steps[0]) == 2  # the conditional and the unconditional call, each of both images
    assert all(k["hidden_states"].shape[0] == 2 and k["encoder_hidden_states"].shape[0] == 2 for _, k in steps[0])
    assert result["config"]["batch"] == 2 and result["config"]["calls_per_step"] == 2


def test_qwen_image_21_profiles_a_step_that_reads_the_prefix_cache(tmp_path, monkeypatch) -> None:
    """Step 0 fills the K/V prefix (text tokens in every block); the profiled step is step 1, of the
    kind of 39 of 40 steps: its call reads the cache, and its products run on image tokens only."""
    script = _load()
    argv = ["--model", "qwen-image-2.1", *TINY, "--steps", "1", "--no-outside"]
    result, _, steps = _spied_run(script, monkeypatch, argv, tmp_path)
    ((_, k),) = steps[0]  # no guidance: one call a step
    assert k["kv_cache_mode"] == "cached" and k["kv_cache"] is not None
    assert k["kv_cache"].get_layer(0).k is not None  # filled by the recording call's step 0
    image_tokens = k["hidden_states"].shape[1]
    blocks = [g for g in result["gemms"] if g["example"].startswith("transformer_blocks.")]
    assert blocks and {g["m"] for g in blocks} == {image_tokens}  # the blocks see no text rows
    assert "step 1 of a pipeline call" in result["config"]["profiled"]


def test_batch_kwargs_give_each_image_its_prompt_and_generator() -> None:
    from benchkit.calls import batch_kwargs
    from benchkit.settings import NEGATIVE, PROMPT, SEED

    ns, cpu = SimpleNamespace(steps_e2e=2), torch.device("cpu")
    one = batch_kwargs("qwen-image", (64, 64), ns, cpu)
    assert one["prompt"] == PROMPT and one["negative_prompt"] == NEGATIVE
    assert one["generator"].initial_seed() == SEED
    three = batch_kwargs("qwen-image", (64, 64), ns, cpu, 3)
    assert three["prompt"] == [PROMPT] * 3 and three["negative_prompt"] == [NEGATIVE] * 3
    assert [g.initial_seed() for g in three["generator"]] == [SEED, SEED + 1, SEED + 2]
    z = batch_kwargs("z-image", (64, 64), ns, cpu, 2)
    assert z["prompt"] == [PROMPT] * 2 and "negative_prompt" not in z and len(z["generator"]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "--batch must be at least 1, got 0"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--warmup-calls", "-1"], "--warmup-calls must be at least 0"),
        (["--resolution", "100x64"], "multiples of 16"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(argv, message, tmp_path, capsys) -> None:
    script = _load()
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", "z-image", "--out", str(tmp_path / "x"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was built or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only refusal")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "full"], "--size full needs a CUDA device"),
        (["--quantize", "fp8"], "--quantize fp8 needs a CUDA device"),
    ],
)
def test_full_size_and_float8_need_cuda(argv, message, tmp_path, capsys) -> None:
    script = _load()
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", "z-image", *argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# -- the GPU side, on a synthetic profile ------------------------------------------------------
class _Event:
    """The few methods of torch's KinetoEvent that the script reads."""

    def __init__(self, name: str, device: str, activity: str, start: int, end: int) -> None:
        self._name, self._activity, self._start, self._end = name, activity, start, end
        self._device = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU

    def name(self) -> str:
        return self._name

    def device_type(self) -> torch.autograd.DeviceType:
        return self._device

    def activity_type(self) -> str:
        return self._activity

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end


GEMM = "nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNT"
FP8_GEMM = "nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT"
QUANT = "triton_red_fused_abs_amax_mul_silu_3"
ATTN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"
COPY = "Memcpy DtoD (Device -> Device)"


def _synthetic_profile(steps: int, fp8: bool = False) -> tuple[SimpleNamespace, list[tuple[str, int, int]]]:
    """A settling step and ``steps`` steps (windows listed out of order, 10 and more of them
    numbered past 9), each with a few kernels, a memcpy, a GPU-side annotation, a synchronisation
    and a runtime call."""
    rng = random.Random(3)
    events = [_Event("profile_step/settle", "cpu", "user_annotation", 0, 900)]
    events += [_Event(GEMM, "cuda", "kernel", 100, 800), _Event("cudaGraphLaunch", "cpu", "cuda_runtime", 50, 60)]
    kernels: list[tuple[str, int, int]] = []
    t = 1_000
    for i in range(steps):
        start = t
        events.append(_Event("cudaGraphLaunch", "cpu", "cuda_runtime", t + 1, t + 5))
        cursor = t + 10
        step_kernels = ((COPY, "gpu_memcpy"), (GEMM, "kernel"), (ATTN, "kernel"), (GEMM, "kernel"))
        if fp8:
            step_kernels = ((QUANT, "kernel"), (FP8_GEMM, "kernel"), (ATTN, "kernel"), (GEMM, "kernel"))
        for name, activity in step_kernels:
            dur = rng.randint(50, 500)
            events.append(_Event(name, "cuda", activity, cursor, cursor + dur))
            kernels.append((name, cursor, cursor + dur))
            cursor += dur + rng.randint(0, 20)
        events.append(_Event(f"profile_step/{i}", "cuda", "gpu_user_annotation", start + 10, cursor))
        events.append(_Event("Event Sync", "cuda", "cuda_sync", cursor, cursor + 5))
        t = cursor + 30
        events.insert(0, _Event(f"profile_step/{i}", "cpu", "user_annotation", start, t))
        t += 100
    kineto = SimpleNamespace(events=lambda: events)
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=kineto)), kernels


def test_timeline_reads_kernels_and_windows_and_leaves_the_settling_step_out() -> None:
    script = _load()
    prof, kernels = _synthetic_profile(12)
    events, windows, counts = script.timeline(prof)
    # annotations, synchronisations and runtime calls left out
    assert [(e.name, e.start_ns, e.end_ns) for e in events] == kernels
    assert len(windows) == 12 and windows == sorted(windows)  # in step order, 10 and 11 after 9
    assert all(b <= s and e <= w_end for (_, s, e), (b, w_end) in zip(kernels[::4], windows))
    assert counts["settle_events"] == 1 and counts["device_events"] == len(kernels) + 1
    assert counts["activity:gpu_user_annotation"] == 12 and counts["activity:gpu_memcpy"] == 12
    assert counts["activity:cuda_sync"] == 12 and counts["activity:kernel"] == 3 * 12 + 1


def test_markdown_of_a_gpu_profile() -> None:
    script = _load()
    prof, kernels = _synthetic_profile(3)
    result = _gpu_result(script, prof)
    md = script.markdown(result, top=2)
    assert md.startswith("# Per-kernel profile: z-image 1024x1024, compiled, CUDA graphs")
    assert "NVIDIA H200 (cuda, driver 570.0, CUDA 12.8)" in md and "bcg-diffusers abc1234" in md
    summary = result["profile"]
    gemm_ms = sum(e - s for n, s, e in kernels if n == GEMM) / 3 / 1e6
    assert f"| gemm | GEMM | 2 | {gemm_ms:.3f} |" in md
    assert f"| idle | | | {summary['idle_ms']:.3f} |" in md
    totals: dict[str, int] = {}
    for name, s, e in kernels:
        totals[name] = totals.get(name, 0) + e - s
    first, second, third = sorted(totals, key=lambda name: -totals[name])
    top = md.split("## Top 2 kernels", 1)[1]
    assert top.index(f"`{first}`") < top.index(f"`{second}`") and f"`{third}`" not in top
    assert "| 1 |" in top and "| 2 |" in top and "| 3 |" not in top


def test_markdown_of_a_float8_profile_beside_bf16_with_its_floor() -> None:
    from benchkit.floor import floor
    from benchkit.gemm_shapes import GemmRow

    script = _load()
    result = _gpu_result(script, _synthetic_profile(3, fp8=True)[0])
    bf16 = _gpu_result(script, _synthetic_profile(3)[0])
    result["config"]["quantize"] = "fp8"
    result["setup"]["quantization"] = "fp8 (torchao float8): 8 Linear layers in float8, 1 in bf16"
    result["beside"] = {"variant": "bf16", **{k: bf16[k] for k in ("setup", "timing", "profile")}}
    rows = [GemmRow(4096, 3072, 12288, True, 4, ["blocks.0.ff"], 1210.0), GemmRow(32, 256, 3072, False, 2, ["t"])]
    kinds = result["profile"]["kinds"]
    assert kinds["fp8_gemm"]["ms_per_step"] > 0 and kinds["quant"]["ms_per_step"] > 0
    result["gemms"] = [r.as_dict() for r in rows]
    result["floor"] = {"fp8": floor(kinds, result["profile"]["idle_ms"], rows, 0.002)}
    md = script.markdown(result, top=3)
    assert md.startswith("# Per-kernel profile: z-image 1024x1024, compiled, CUDA graphs, fp8")
    assert "8 Linear layers in float8" in md and "The bf16 step beside it" in md
    fp8_ms, bf16_ms = kinds["fp8_gemm"]["ms_per_step"], bf16["profile"]["kinds"]["fp8_gemm"]["ms_per_step"]
    assert f"| fp8_gemm | GEMM | 1 | {fp8_ms:.3f} |" in md and bf16_ms == 0
    assert "| quant | fp8 quantization | 1 |" in md
    assert "| fp8 | 4096 | 3072 | 12288 | 4 |" in md and "| 1210 |" in md
    assert "## Floor: fp8" in md and "| fp8_gemm |" in md.split("## Floor: fp8")[1]


def _gpu_result(script, prof) -> dict:
    from benchkit.timeline import summarize

    events, windows, counts = script.timeline(prof)
    summary = summarize(events, windows)
    return {
        "env": {
            "device": "cuda",
            "device_name": "NVIDIA H200",
            "driver": "570.0",
            "cuda": "12.8",
            "torch": "2.13.0",
            "diffusers": "0.42.1",
            "transformers": "5.0",
            "python": "3.11",
            "git_commit": "abc1234",
            "git_dirty": False,
            "date": "2026-01-01 00:00:00 UTC",
        },
        "config": {
            "model": "z-image",
            "resolution": "1024x1024",
            "size": "full",
            "dtype": "bf16",
            "compile": True,
            "graphs": True,
            "steps": 3,
            "warmup_calls": 2,
            "calls_per_step": 1,
            "calls": ["[16x1x128x128], 1, [32x2560]"],
        },
        "setup": {
            "describe": "ZImagePipeline",
            "warmup_s": 40.0,
            "compile_s": 35.0,
            "compiled_blocks": 34,
            "captures": 1,
            "graph_mb": 900.0,
            "warmup_skipped": None,
        },
        "timing": {"step_ms": 0.002},
        "counts": counts,
        "profile": summary,
        "notes": [],
    }
