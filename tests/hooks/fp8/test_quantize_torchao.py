"""quantize="fp8" with the real torchao quantizer, on the CPU.

torchao refuses float8 on the CPU only in its device checks: ``torch._scaled_mm`` has a CPU
kernel, so with those checks passed (``torchao_on_cpu``) its float8 tensors run here through the
same library code as on a GPU, on other kernels. What these tests show holds for the code
around the kernels: the weights fingerprint on torchao's tensor subclasses, graphs (emulated)
replaying the quantized model bit for bit, dynamo tracing a float8 layer whole, zero rows, and a
model diffusers quantized when it was loaded. Speed and the GPU's kernels: tests/cuda/test_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.fp8.quantizers import TorchAOFloat8, quantized_when_loaded
from accel.hooks.fp8.scaled_mm import Float8RowwiseLinear, ScaledMMFloat8
from accel.hooks.state.weights import weights_fingerprint
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.fake_quant import torchao_on_cpu
from tests.helpers.generate import generate

pytest.importorskip("torchao")

QUANTIZERS = [TorchAOFloat8, ScaledMMFloat8]


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    torchao_on_cpu(monkeypatch)
    return monkeypatch


def _layer(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128, dtype=torch.bfloat16))


@torch.no_grad()
def test_both_float8_quantizers_compute_the_same_bits_and_keep_zero_rows_finite(on_cpu) -> None:
    a, b = _layer(), _layer()
    assert TorchAOFloat8().quantize(a, ["0"]) == ["0"] and ScaledMMFloat8().quantize(b, ["0"]) == ["0"]
    assert type(a[0]) is torch.nn.Linear and type(b[0]) is Float8RowwiseLinear
    ref = _layer()
    for shape in [(3, 5, 64), (7, 64), (1, 2, 64)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        x.view(-1, 64)[0] = 0  # a row of zeros: a zero scale would make it NaN
        out = a(x)
        assert torch.equal(out, b(x)) and torch.isfinite(out).all()
        assert torch.equal(out.view(-1, 128)[0], ref[0].bias.detach())
        rel = (out.float() - ref(x).float()).norm() / ref(x).float().norm()
        assert 0 < rel < 0.1  # float8's rounding, not something else


def test_the_fingerprint_walks_into_float8_weights(on_cpu) -> None:
    m = _layer()
    TorchAOFloat8().quantize(m, ["0"])
    weight = m[0].weight
    assert weight.data_ptr() == 0  # a wrapper: its own address says nothing
    first = weights_fingerprint(m)
    assert weights_fingerprint(m) == first  # the same weights: nothing changed
    with torch.no_grad():
        weight.qdata.view(torch.uint8).bitwise_xor_(1)  # the float8 data changed in place
    changed = weights_fingerprint(m)
    assert changed != first
    with torch.no_grad():
        weight.scale.mul_(2)
    assert weights_fingerprint(m) != changed


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: q.__name__)
@torch.no_grad()
def test_dynamo_traces_a_float8_layer_whole_with_its_activation_quantization(on_cpu, quantizer) -> None:
    from torch._dynamo.backends.common import aot_autograd

    m = _layer()
    quantizer().quantize(m, ["0"])
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(m, backend=aot_autograd(fw_compiler=keep), fullgraph=True, dynamic=True)
        for shape in [(3, 5, 64), (2, 9, 64)]:
            x = torch.randn(*shape, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), m(x))
    finally:
        torch._dynamo.reset()
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    if quantizer is TorchAOFloat8:
        # One graph holds the activation's per-row scale (abs, amax, div) and the float8 product.
        assert len(graphs) == 1 and {"aten.amax.default", "aten.abs.default", "aten._scaled_mm.default"} <= ops, ops
    else:
        # One graph: the one-pass quantization and the float8 product, each one opaque op.
        want = {"bcg_diffusers.quantize_rows_e4m3.default", "bcg_diffusers.scaled_mm_rowwise.default"}
        assert len(graphs) == 1 and want <= ops and "aten.amax.default" not in ops, ops


def test_graphs_replay_the_float8_model_bit_for_bit_and_keep_their_captures(on_cpu) -> None:
    emulate_pipelines(on_cpu)
    pipe = build_pipeline("z-image", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    bf16 = generate(pipe, guidance=0.0)
    accelerate_pipeline(pipe, quantize="fp8", text_encoder=False, vae=False, capture_on_miss=True)
    pipe.accel.warmup((64, 64), cfg=False, progress=False)
    sel = pipe.accel.quantization.selection
    # Z-Image's tiny feed-forwards (170 wide) are not multiples of 16: float8 cannot take them.
    assert len(sel.quantized) == 16 and len(sel.not_taken) == 12 and len(sel.kept_by_recipe) == 9
    generate(pipe, guidance=0.0)  # captures this call's own signature (its caption length)
    st0 = pipe.accel.stats()["transformer"]
    assert st0.captures > 0 and not pipe.accel.found_breaks
    assert all(n == 1 for n in st0.segments_per_entry)  # the activations' quantization is no break
    outs = [generate(pipe, guidance=0.0) for _ in range(2)]
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        eager = generate(pipe, guidance=0.0)
    finally:
        runner.enabled = True
    st = pipe.accel.stats()["transformer"]
    assert st.replays > st0.replays and st.captures == st0.captures and st.eager_calls == st0.eager_calls
    assert torch.equal(outs[0], eager) and torch.equal(outs[1], eager)
    assert 0 < ((eager.float() - bf16.float()).norm() / bf16.float().norm()).item() < sel.budget * 4


def test_a_model_quantized_when_loaded_through_torchao_config_is_used_as_it_is(on_cpu, tmp_path) -> None:
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    pipe = build_pipeline("z-image", "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.save_pretrained(tmp_path)
    loaded = type(pipe.transformer).from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), torch_dtype=torch.bfloat16
    )
    pipe = type(pipe)(**{**pipe.components, "transformer": loaded})
    pipe.set_progress_bar_config(disable=True)
    assert quantized_when_loaded(loaded) == "quantized when loaded (torchao, 37 layers with torchao weights)"
    want = generate(pipe, guidance=0.0)
    accelerate_pipeline(pipe, quantize="fp8")
    assert not pipe.accel.quantization.pending
    pipe.accel.warmup((64, 64), cfg=False, progress=False)
    assert pipe.accel.quantization.selection is None  # not measured, not quantized again
    assert torch.equal(generate(pipe, guidance=0.0), want)
    assert (
        "  transformer: quantized when loaded (torchao, 37 layers with torchao weights): used as it is, not measured"
        in pipe.accel.report()
    )
    assert weights_fingerprint(loaded) == weights_fingerprint(loaded)
