"""scripts/benchkit/kernels.py and timeline.py: kernel kinds read from names recorded on
H100/H200 traces (float8 products and quantization among them), the busy-interval union and idle
time on synthetic intervals, and the per-step summary."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchkit.kernels import GROUPS, KINDS, fused_ops, kind
from benchkit.timeline import DeviceEvent, busy_ns, clip, idle_ns, summarize, union

# Names as CUPTI records them (demangled; long template arguments shortened where they say nothing).
NAMES = {
    # cuBLAS / cuBLASLt / CUTLASS on sm90, and what an inductor template or cuBLAS split-K adds
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNT": "gemm",
    "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)": "gemm",
    "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnt_align8_warpspecialized_cooperative_epi_tma": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, float>)": "gemm",
    "triton_tem_fused_addmm_0": "gemm",
    "triton_tem_fused_mm_3": "gemm",
    # float8 products (torch._scaled_mm): cuBLASLt's nvjet with two float8 operands ("qq") and its
    # xmma e4m3 kernels, as public traces name them; not yet recorded here, and of the form torch's
    # sources give: CUTLASS's rowwise template (RowwiseScaledMM.cu, arguments shortened), an
    # inductor template
    "nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT": "fp8_gemm",
    "nvjet_qqtst_112x128_128x7_2x1_v_bz_coopA_algo2_TNN": "fp8_gemm",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "fp8_gemm",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<2, cute::tuple<cute::C<1>, cute::C<2>, cute::C<1>>, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>, cutlass::float_e4m3_t, cutlass::float_e4m3_t>>>>(...)": "fp8_gemm",
    "triton_tem_fused__scaled_mm_4": "fp8_gemm",
    # Recorded on an H100 (Z-Image fp8, 2026-12-06): inductor names the activation's quantization
    # after the _scaled_mm it feeds; fused with the SiLU product or the RMS norm before it.
    "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_mul_silu_t_unsqueeze_view_5": "quant",
    "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_div_mean_mul_pow_rsqrt_split_t_tanh_unsqueeze_view_4": (
        "quant"
    ),
    "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_permute_t_unsqueeze_view_3": "quant",
    # The library's one-pass quantization (accel/hooks/fp8/row_quant_kernel.py), as profilers name it.
    "quantize_rows_kernel": "quant",
    # ... and its modulated LayerNorm that writes float8 rows (accel/hooks/fp8/norm_quant_kernel.py).
    "modulated_norm_rows_kernel": "quant",
    # float8 quantization of activations: inductor's amax reductions (alone or fused into their
    # producer) and scale-clamp-cast kernels as public traces name them; of the form the sources
    # give (not recorded here): a norm fused with its output's quantization, ATen's cast to float8
    # (its element type in the name), a library's quantizer
    "triton_red_fused_abs_amax_9": "quant",
    "triton_red_fused_abs_amax_mul_silu_3": "quant",
    "triton_red_fused_abs_amax_transpose_view_3": "quant",
    "triton_red_fused__to_copy_abs_clamp_max_mul_pow_reciprocal_relu_view_7": "quant",
    "triton_poi_fused__to_copy_clamp_div_mul_round_view_15": "quant",
    "triton_red_fused__to_copy_abs_add_amax_clamp_div_mean_mul_pow_rsqrt_2": "quant",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#14}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, at::detail::Array<char*, 2>) [c10::Float8_e4m3fn]": "quant",
    "quantize_fp8_kernel_generic": "quant",
    # attention: torch's flash and memory-efficient backends, cuDNN SDPA, FlashAttention-3
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false>(pytorch_flash::Flash_fwd_params)": "attention",
    "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>, false, false, false, true, true, false>(pytorch_flash::Flash_fwd_params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)": "attention",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>>>>>(flash::FlashAttnFwdSm90<>::Params)": "attention",
    "triton_per_fused__softmax_10": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "attention",
    # norms: inductor's fused RMS norm (pow, mean, rsqrt) and layer norm, ATen's own
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3": "norm",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_view_as_complex_12": "norm",
    "triton_red_fused_add_mul_native_layer_norm_7": "norm",
    "triton_per_fused_native_layer_norm_0": "norm",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)": "norm",
    "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float>(long, float, float const*, float*, float*)": "norm",
    # activations
    "triton_poi_fused_gelu_1": "activation",
    "triton_poi_fused_mul_silu_2": "activation",
    "triton_poi_fused__to_copy_add_gelu_mul_tanh_5": "activation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)": "activation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)": "activation",
    # rotary embeddings: complex views and products, cat/stack of a negated half, sin/cos tables
    "triton_poi_fused_cat_mul_neg_stack_4": "rope",
    "triton_poi_fused__to_copy_mul_view_as_complex_view_as_real_9": "rope",
    "triton_poi_fused_cat_cos_sin_2": "rope",
    "void at::native::vectorized_elementwise_kernel<4, at::native::binary_internal::MulFunctor<c10::complex<float> >, at::detail::Array<char*, 3> >(int, at::native::binary_internal::MulFunctor<c10::complex<float> >, at::detail::Array<char*, 3>)": "rope",
    # other pointwise and reduction kernels
    "triton_poi_fused__to_copy_add_mul_0": "elementwise",
    "triton_poi_fused_add_div_mul_where_6": "elementwise",
    "triton_poi_fused__to_copy_clamp_max_exp_mul_sub_12": "elementwise",  # clamped exp: no float8 scale
    "triton_poi_fused__to_copy_clamp_sub_3": "elementwise",
    "triton_red_fused_sum_1": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)": "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&)::{lambda(int)#1})": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)": "elementwise",
    # copies, casts, fills: the runtime's records, ATen's copy / cat / fill, inductor's data movement
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memcpy HtoD (Pageable -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10::BFloat16)#1} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&)::{lambda(int)#1})": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, at::detail::Array<char*, 2>)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 2, 128, 1>(at::native::(anonymous namespace)::OpaqueType<2u>*, at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 128, 1>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<c10::BFloat16>, at::detail::Array<char*, 1>)": "copy",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, at::IntArrayRef)::{lambda(int)#1}>(long, at::native::gpu_index_kernel<>::{lambda(int)#1})": "copy",
    "triton_poi_fused__to_copy_6": "copy",
    "triton_poi_fused_cat_8": "copy",
    "triton_poi_fused_clone_5": "copy",
    "triton_poi_fused__unsafe_view_clone_permute_11": "copy",
    "triton_poi_fused_constant_pad_nd_13": "copy",
    # anything else
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "other",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, long, unsigned int>::Policy900, false, long, long, unsigned int, int, int>(int*, int*, unsigned int*)": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kind_of_real_kernel_names(name: str) -> None:
    assert kind(name) == NAMES[name], name
    assert kind(name.upper() if name.startswith("triton_") else name) == NAMES[name]  # case does not matter


def test_every_kind_is_exercised_and_nothing_falls_outside_the_kinds() -> None:
    assert set(NAMES.values()) == set(KINDS) == set(GROUPS)
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz_<>:0123456789 "
    for _ in range(300):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert kind(name) in KINDS, name


def test_fused_ops_reads_inductor_names() -> None:
    assert fused_ops("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3") == (
        "red",
        ("tocopy", "add", "mean", "mul", "pow", "rsqrt"),
    )
    assert fused_ops("triton_per_fused_native_layer_norm_12") == ("per", ("nativelayernorm",))
    assert fused_ops("triton_poi_fused_0") == ("poi", ())
    assert fused_ops("triton_poi_fused_0") is not None and kind("triton_poi_fused_0") == "elementwise"  # no ops named
    assert fused_ops("void at::native::vectorized_elementwise_kernel<4>") is None
    assert fused_ops("Memcpy DtoD (Device -> Device)") is None


# -- intervals --------------------------------------------------------------------------------
def _covered(intervals: list[tuple[int, int]]) -> set[int]:
    """The integer instants [s, e) covered: the brute-force reference for the union."""
    return {t for s, e in intervals for t in range(s, e)}


def test_union_busy_and_idle_by_hand() -> None:
    spans = [(10, 20), (15, 30), (30, 35), (50, 60), (55, 58), (70, 70), (90, 80)]
    assert union(spans) == [(10, 35), (50, 60)]  # overlapping and touching joined, empty and reversed dropped
    assert busy_ns(spans) == 35
    assert clip(spans, 12, 55) == [(12, 20), (15, 30), (30, 35), (50, 55)]
    assert idle_ns((0, 100), spans) == 100 - 35
    assert idle_ns((12, 55), spans) == (55 - 12) - ((35 - 12) + (55 - 50))
    assert idle_ns((36, 49), spans) == 13  # nothing runs in the window
    assert idle_ns((40, 30), spans) == 0  # an empty window has no idle time
    assert busy_ns([]) == 0 and union([]) == []


def test_union_busy_and_idle_against_brute_force() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(0, 12)):
            s = rng.randint(0, 200)
            spans.append((s, s + rng.randint(-5, 40)))
        merged = union(spans)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(merged)), "disjoint, sorted, not touching"
        assert _covered(merged) == _covered(spans)
        assert busy_ns(spans) == len(_covered(spans))
        start = rng.randint(0, 150)
        end = start + rng.randint(0, 100)
        window = set(range(start, end))
        assert idle_ns((start, end), spans) == len(window - _covered(spans))


# -- the summary --------------------------------------------------------------------------------
GEMM = "nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNT"
NORM = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3"
COPY = "Memcpy DtoD (Device -> Device)"


def _random_steps(rng: random.Random, n: int) -> tuple[list[DeviceEvent], list[tuple[int, int]]]:
    events, windows, t = [], [], 1_000
    for _ in range(n):
        start, cursor = t, t + rng.randint(5_000, 20_000)  # launch latency before the first kernel
        for _ in range(rng.randint(3, 9)):
            name = rng.choice((GEMM, NORM, COPY))
            dur = rng.randint(1_000, 50_000)
            # now and then a kernel on a second stream, overlapping the previous one
            s = max(start + 1, cursor - rng.randint(0, dur)) if rng.random() < 0.2 else cursor + rng.randint(0, 3_000)
            events.append(DeviceEvent(name, s, s + dur))
            cursor = max(cursor, s + dur)
        t = cursor + rng.randint(2_000, 9_000)  # the synchronisation returning
        windows.append((start, t))
        t += rng.randint(10_000, 30_000)  # host time between steps: outside every window
    return events, windows


def test_summarize_adds_up() -> None:
    rng = random.Random(7)
    events, windows = _random_steps(rng, 4)
    stray = DeviceEvent(GEMM, windows[-1][1] + 5, windows[-1][1] + 50)  # after the last window
    early = DeviceEvent(COPY, 0, 10)  # before the first
    s = summarize([stray, *events, early], list(reversed(windows)))  # the order of windows does not matter
    n = len(windows)
    assert s["steps"] == n and s["unassigned"] == 2 and s["events"] == len(events)
    wall = sum(e - b for b, e in windows)
    assert s["step_ms"] == pytest.approx(wall / n / 1e6, abs=1e-4)
    busy = sum(busy_ns(clip([(ev.start_ns, ev.end_ns) for ev in events], b, e)) for b, e in windows)
    assert s["busy_ms"] == pytest.approx(busy / n / 1e6, abs=1e-4)
    assert s["idle_ms"] == pytest.approx((wall - busy) / n / 1e6, abs=1e-4)
    assert s["idle_share"] == pytest.approx((wall - busy) / wall, abs=1e-4)
    assert 0 < s["gaps_ms"] < s["idle_ms"]  # launch latency and the synchronisation lie at the edges
    total = sum(ev.end_ns - ev.start_ns for ev in events)
    assert s["kernel_ms"] == pytest.approx(total / n / 1e6, abs=1e-4)
    assert s["overlap_ms"] == pytest.approx(s["kernel_ms"] - s["busy_ms"], abs=2e-4)
    # Each name once, with its kind; the kinds' totals are their kernels'.
    for name, want_kind in ((GEMM, "gemm"), (NORM, "norm"), (COPY, "copy")):
        mine = [ev for ev in events if ev.name == name]
        k = s["kernels"][name]
        assert k["kind"] == want_kind and k["count"] == len(mine)
        assert k["total_us"] == pytest.approx(sum(ev.duration_ns for ev in mine) / 1e3, abs=0.1)
        assert s["kinds"][want_kind]["total_us"] == k["total_us"]
        assert s["kinds"][want_kind]["count_per_step"] == pytest.approx(len(mine) / n, abs=0.01)
    assert list(s["kinds"]) == list(KINDS)
    assert list(s["kernels"]) == sorted(s["kernels"], key=lambda name: -s["kernels"][name]["total_us"])
    assert sum(k["share"] for k in s["kinds"].values()) + s["idle_share"] == pytest.approx(
        1 + s["overlap_ms"] / s["step_ms"], abs=1e-3
    )
    assert [p["events"] for p in s["per_step"]] == [sum(1 for ev in events if b <= ev.start_ns < e) for b, e in windows]


def test_summarize_without_events_or_windows() -> None:
    s = summarize([], [(0, 2_000_000), (5_000_000, 6_000_000)])
    assert s["events"] == 0 and s["kernels"] == {} and s["busy_ms"] == 0
    assert s["step_ms"] == pytest.approx(1.5) and s["idle_share"] == 1.0
    assert all(k["total_us"] == 0 for k in s["kinds"].values())
    with pytest.raises(ValueError, match="windows"):
        summarize([DeviceEvent(GEMM, 0, 1)], [])
