"""scripts/bench_parallel.py on CPU worker processes (gloo, tiny models): the tables it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import ROOT, launch_ranks

sys.path.insert(0, str(ROOT / "scripts"))
from benchkit import parallel_calls, parallel_profile


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("c10d::alltoall_base_", "communication"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("aten::addmm", "gemm"),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copy"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("triton_poi_fused_add_mul_0", "other"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert parallel_profile.kernel_kind(name) == kind


def test_two_processes_write_latency_and_profile_tables(tmp_path: Path) -> None:
    out = tmp_path / "res"
    args = ["--size", "tiny", "--models", "qwen-image", "--resolutions", "64", "--steps", "2", "--runs", "1"]
    args += ["--timeout", "60", "--profile", "--skip-parallel-eager", "--branches-apart", "--out", str(out)]
    procs = launch_ranks(str(ROOT / "scripts" / "bench_parallel.py"), 2, tmp_path, *args)
    try:
        codes = [p.wait(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("bench_parallel did not finish: " + (tmp_path / "rank0.log").read_text()[-3000:])
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]

    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    # no parallel eager; Ulysses once more with its guidance calls apart
    assert list(rows) == [
        "1 GPU eager",
        "1 GPU graphs",
        "cfg graphs",
        "ulysses graphs",
        "ulysses graphs, branches apart",
    ]
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["cfg graphs"]["diff"] == 0  # the two guidance branches on two processes, bit for bit
    for label, row in rows.items():
        ms = row["profile_ms"]
        assert set(ms) == set(parallel_profile.KIND_NAMES) and sum(ms.values()) > 0
        # the one-process variants exchange nothing; the parallel ones do
        assert (ms["communication"] > 0) == (label != "1 GPU eager" and label != "1 GPU graphs"), (label, ms)
    assert ms["attention"] > 0 and ms["gemm"] > 0
    md = (out / "results.md").read_text()
    assert "| qwen-image | 64 | ulysses graphs |" in md and "time of one profiled call on rank 0" in md


def test_decoded_images_are_compared_pixel_by_pixel() -> None:
    from PIL import Image

    a = parallel_calls.as_tensor([Image.new("RGB", (4, 2), (10, 20, 30)), Image.new("RGB", (4, 2), (0, 0, 0))])
    assert a.shape == (2, 2, 4, 3) and a.dtype.is_floating_point
    assert a[0, 1, 3].tolist() == [10.0, 20.0, 30.0] and a[1].abs().sum() == 0
    b = parallel_calls.as_tensor([Image.new("RGB", (4, 2), (10, 20, 31)), Image.new("RGB", (4, 2), (0, 0, 0))])
    assert (a - b).abs().max() == 1  # one level of one channel: a difference, not "exact"
