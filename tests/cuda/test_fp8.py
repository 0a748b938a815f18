"""quantize="fp8" on a GPU of compute capability 8.9 or newer: full-size Z-Image and Qwen-Image.

Both float8 quantizers run (torchao's tensor subclass, the default; the opaque ``scaled_mm`` op of
accel/hooks/fp8/scaled_mm.py), so one run tells which path CUDA graphs and compile take:

* one float8 layer: both quantizers give the same bits eagerly, and a plain ``torch.cuda.CUDAGraph``
  captures and replays each (a host sync in the path would fail the capture), compiled too;
* the selection keeps the first warm-up call within ``fp8_budget``;
* graphs replay the quantized model bit for bit with it run eagerly (the runner off): shuffled
  calls, outputs NaN-poisoned before each, no recapture (the weights fingerprint sees the float8
  weights unchanged) and no eager call;
* quantizing the activations adds no break: as many segments per graph as the bf16 model has,
  no break found;
* ``compile=True`` over the quantized model: graphs equal the same compiled model without graphs;
* the one-pass Triton quantization (accel/hooks/fp8/row_quant.py) gives the tensor ops' bits in
  every dtype, at row lengths up to and past what it holds in registers, for zero, huge and
  strided rows; after a GELU(tanh), within one float8 step of them.

Distances to bf16 are printed (the bench, scripts/bench_fp8.py, publishes them at 1024x1024).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from accel import accelerate_pipeline
from accel.graphs.tree import tensors
from accel.hooks.fp8 import layer_kinds, quantizers
from accel.hooks.fp8.scaled_mm import ScaledMMFloat8
from pipelines.builders import build_pipeline

pytestmark = pytest.mark.cuda

BACKENDS = {"torchao": quantizers.TorchAOFloat8, "scaled-mm": ScaledMMFloat8}
SIZE = (512, 512)
DEVICE = "cuda"
PROMPTS = ["a red fox in fresh snow at dawn", "an isometric cutaway of a tiny underground library lit by lanterns"]


@pytest.fixture(autouse=True)
def float8_gpu() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < quantizers.MIN_FP8_CAPABILITY:
        pytest.skip("float8 products need compute capability 8.9 or newer")


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torchao":
        pytest.importorskip("torchao")
    monkeypatch.setitem(quantizers.QUANTIZERS, "fp8", BACKENDS[request.param])
    monkeypatch.setattr(layer_kinds, "FP8_LAYERS", dict.fromkeys(layer_kinds.FP8_LAYERS, BACKENDS[request.param]))
    return request.param


@torch.no_grad()
def test_one_float8_layer_is_the_same_in_both_paths_and_replays_in_a_plain_cuda_graph() -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    base = torch.nn.Linear(3072, 12288, device="cuda", dtype=torch.bfloat16)
    layers = {}
    for name, quantizer in BACKENDS.items():
        m = torch.nn.Sequential(torch.nn.Linear(3072, 12288, device="cuda", dtype=torch.bfloat16))
        m[0].load_state_dict(base.state_dict())
        assert quantizer().quantize(m, ["0"]) == ["0"]
        layers[name] = m
    x = torch.randn(2, 4096, 3072, device="cuda", dtype=torch.bfloat16)
    ref = base(x).float()
    eager = {name: m(x) for name, m in layers.items()}
    for name, m in layers.items():
        rel = ((eager[name].float() - ref).norm() / ref.norm()).item()
        print(f"\none float8 layer ({name}): {rel:.4f} from bf16 (relative L2)")
        assert 0 < rel < 0.1
        for compiled in (False, True):
            f = torch.compile(m, fullgraph=True) if compiled else m
            static = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm (and compile) outside the capture, as torch's docs do
                for _ in range(2):
                    f(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = f(static)
            static.copy_(torch.randn_like(static))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, f(static)), f"{name} compiled={compiled}: the replay differs"
    torch._dynamo.reset()
    assert torch.equal(eager["torchao"], eager["scaled-mm"]), "the two float8 paths computed different bits"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@torch.no_grad()
def test_one_pass_quantization_gives_the_tensor_ops_bits(dtype: torch.dtype) -> None:
    from accel.hooks.fp8.row_quant import MAX_ROW, quantize_rows_e4m3, quantize_rows_reference

    g = torch.Generator(DEVICE).manual_seed(0)
    for rows, k in [(1, 16), (33, 3072), (4096, 3072), (257, 5000), (64, 12288), (5, MAX_ROW), (3, MAX_ROW + 16)]:
        wide = torch.randn(rows, k + 48, device=DEVICE, dtype=dtype, generator=g) * 3
        wide[0, :] = 0  # a zero row keeps a finite scale and zeros
        if rows > 2:
            wide[1, 5] = 400.0 if dtype == torch.float16 else 3e4  # a huge value sets its row's scale
            wide[2, :] *= 1e-6
            wide[-1, :4] = -0.0  # negative zeros stay negative
        for x in (wide[:, :k].contiguous(), wide[:, :k]):  # contiguous, and rows with a stride
            q, scale = quantize_rows_e4m3(x)
            want_q, want_scale = quantize_rows_reference(x)
            assert torch.equal(scale, want_scale), f"{dtype} {rows}x{k}: the scales differ"
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), f"{dtype} {rows}x{k}: the values differ"
            assert torch.isfinite(q[0].float()).all() and not q[0].float().any()


@torch.no_grad()
def test_one_pass_quantization_after_a_gelu_is_within_one_float8_step_of_the_two_ops() -> None:
    from accel.hooks.fp8.row_quant import quantize_rows_e4m3, quantize_rows_reference

    g = torch.Generator(DEVICE).manual_seed(1)
    x = torch.randn(4096, 12288, device=DEVICE, dtype=torch.bfloat16, generator=g) * 2
    q, scale = quantize_rows_e4m3(x, True)
    want_q, want_scale = quantize_rows_reference(x, True)
    a, b = q.float() * scale, want_q.float() * want_scale
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item()
    rel = ((a - b).norm() / b.norm()).item()
    print(f"\nGELU(tanh) then float8 in one pass: {differ:.2e} of the values differ, {rel:.2e} relative L2")
    # An e4m3 step is 1/8 of a value's power of two: at most that far, and rarely.
    assert ((a - b).abs() <= b.abs() / 8 + scale * 2**-9).all()
    assert differ < 1e-3 and (scale == want_scale).float().mean().item() > 0.99


@torch.no_grad()
def test_one_pass_silu_mul_quantization_is_within_one_float8_step_of_the_tensor_ops() -> None:
    """Qwen-Image 2.1's down-projection input (4096 rows of 12288), its gate and up projections'
    outputs as strided halves of one tensor; the kernel's SiLU uses the fast exponential."""
    from accel.hooks.fp8.row_quant import quantize_silu_mul_rows_e4m3, quantize_silu_mul_rows_reference

    g = torch.Generator(DEVICE).manual_seed(2)
    both = torch.randn(4096, 2 * 12288, device=DEVICE, dtype=torch.bfloat16, generator=g) * 3
    gate, up = both[:, :12288], both[:, 12288:]
    for gate_, up_ in ((gate, up), (gate.contiguous(), up.contiguous())):
        q, scale = quantize_silu_mul_rows_e4m3(gate_, up_)
        want_q, want_scale = quantize_silu_mul_rows_reference(gate_, up_)
        a, b = q.float() * scale, want_q.float() * want_scale
        differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item()
        print(f"\nSiLU(gate) * up then float8 in one pass: {differ:.2e} of the values differ")
        assert ((a - b).abs() <= b.abs() / 8 + scale * 2**-9).all()
        assert differ < 1e-3 and (scale == want_scale).float().mean().item() > 0.99


def _call(pipe, name: str, prompt: str, seed: int) -> torch.Tensor:
    guidance = dict(true_cfg_scale=4.0, negative_prompt="blurry") if name == "qwen-image" else dict(guidance_scale=0.0)
    return pipe(
        prompt=prompt,
        width=SIZE[0],
        height=SIZE[1],
        num_inference_steps=4,
        generator=torch.Generator(DEVICE).manual_seed(seed),
        output_type="latent",
        **guidance,
    ).images


def _poison(pipe) -> None:
    for entry in pipe.accel.runners["transformer"].store.entries.values():
        for chain in entry.tree.chains.values():
            for t in [*tensors(chain.output), *(t for b in chain.graph.breaks for t in tensors(b.buffer))]:
                if t.is_floating_point():
                    t.fill_(float("nan"))


def _warmup(pipe, name: str):
    return pipe.accel.warmup(
        [SIZE],
        prompts=PROMPTS,
        negative_prompt="blurry" if name == "qwen-image" else None,
        cfg=name == "qwen-image",
        progress=False,
    )


def _without_graphs(pipe, name: str, prompt: str, seed: int) -> torch.Tensor:
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        return _call(pipe, name, prompt, seed)
    finally:
        runner.enabled = True


def _replays_equal_without_graphs(pipe, name: str, bf16: dict) -> list[str]:
    """Shuffled calls, outputs poisoned: each graph replay against the same model without graphs."""
    cases = [(p, s) for p in PROMPTS for s in (0, 1)]
    random.Random(0).shuffle(cases)
    st0 = pipe.accel.stats()["transformer"]
    mismatches = []
    for prompt, seed in cases:
        want = _without_graphs(pipe, name, prompt, seed)
        _poison(pipe)
        out = _call(pipe, name, prompt, seed)
        if not torch.equal(out, want):
            mismatches.append(f"{prompt[:12]!r} seed {seed}: max diff {(out.float() - want.float()).abs().max():.4g}")
        if (prompt, seed) in bf16:
            ref = bf16[prompt, seed].float()
            print(f"  {prompt[:12]!r} seed {seed}: {((out.float() - ref).norm() / ref.norm()).item():.4f} from bf16")
    st = pipe.accel.stats()["transformer"]
    assert st.captures == st0.captures, "captured again: the float8 weights looked changed"
    assert st.eager_calls == st0.eager_calls and st.misses == st0.misses and st.replays > st0.replays
    return mismatches


def _bf16_baseline(pipe, name: str) -> tuple[list[int], dict]:
    accelerate_pipeline(pipe)
    _warmup(pipe, name)
    segments = pipe.accel.stats()["transformer"].segments_per_entry
    bf16 = {(p, s): _call(pipe, name, p, s) for p in PROMPTS for s in (0,)}
    pipe.accel.restore()
    return segments, bf16


def _quantized_session(pipe, name: str, tmp_path) -> None:
    segments, bf16 = _bf16_baseline(pipe, name)
    accelerate_pipeline(pipe, quantize="fp8")
    report = _warmup(pipe, name)
    print(f"\n{name} quantize='fp8' warm-up:\n{report}\n" + "\n".join(pipe.accel.quantization.describe()))
    sel = pipe.accel.quantization.selection
    assert sel is not None and sel.quantized and sel.error <= sel.budget
    st = pipe.accel.stats()["transformer"]
    assert sorted(st.segments_per_entry) == sorted(segments), "quantizing added a break"
    assert not pipe.accel.found_breaks
    mismatches = _replays_equal_without_graphs(pipe, name, bf16)
    if name == "qwen-image":
        joined, _ = pipe.accel.guidance_batches()["transformer"]
        assert joined > 0, "the guidance branches were not joined at 512x512"
    print(pipe.accel.report())
    pipe.accel.restore()  # the float8 layers stay
    assert not mismatches, mismatches

    torch._dynamo.reset()
    accelerate_pipeline(pipe, quantize="fp8", compile=True, compile_cache_dir=tmp_path / "kernels")
    assert not pipe.accel.quantization.pending  # quantized already: used as it is
    report = _warmup(pipe, name)
    print(f"\n{name} quantize='fp8' compile=True warm-up:\n{report}")
    assert report.total_compile_seconds > 0
    assert sorted(pipe.accel.stats()["transformer"].segments_per_entry) == sorted(segments)
    assert not pipe.accel.found_breaks
    mismatches = _replays_equal_without_graphs(pipe, name, bf16)
    pipe.accel.restore()
    assert not mismatches, mismatches


@torch.no_grad()
def test_z_image_float8_graphs_equal_float8_eager_and_compiled(backend: str, tmp_path) -> None:
    pipe = build_pipeline("z-image", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    try:
        _quantized_session(pipe, "z-image", tmp_path)
    finally:
        del pipe
        gc.collect()
        torch.cuda.empty_cache()


@torch.no_grad()
def test_qwen_image_float8_graphs_equal_float8_eager_and_compiled(backend: str, tmp_path) -> None:
    pipe = build_pipeline("qwen-image", "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    try:
        _quantized_session(pipe, "qwen-image", tmp_path)
    finally:
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
