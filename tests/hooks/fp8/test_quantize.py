"""quantize="fp8" on the CPU: its refusals, and the layer selection against a stand-in quantizer.

The stand-in (tests/helpers/fake_quant.py) rounds weights and activations per row to a grid we
choose, so which layers are worst, the budget loop and the report lines are known and repeat bit
for bit; the real torchao quantizer runs the same code (tests/hooks/fp8/test_quantize_torchao.py, and
on a GPU tests/cuda/test_fp8.py).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.fp8 import quantize as quantize_mod
from accel.hooks.fp8 import quantizers
from accel.hooks.fp8.layer_select import distance, select_layers
from accel.hooks.fp8.quantizers import QuantizeError, check_fp8_device
from accel.hooks.graph_hook import graph_hook_of
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image.recipe import QwenImageRecipe
from tests.helpers.fake_quant import GridLinear, GridQuantizer, use_grid
from tests.helpers.generate import generate

COARSE = "transformer_blocks.1.img_mlp.net.2"  # one level per sign: by far the worst layer
QWEN_KEPT = (
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "img_in",
    "txt_in",
    *(
        f"transformer_blocks.{i}.{name}"
        for i in (0, 1)
        for name in (
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.add_q_proj",
            "attn.to_add_out",
            "txt_mlp.net.0.proj",
            "txt_mlp.net.2",
        )
    ),
    "norm_out.linear",
    "proj_out",
)


def _pipe(name: str = "qwen-image", **kwargs):
    pipe = build_pipeline(name, "tiny", **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, (torch.nn.Linear, GridLinear))}


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# -- refusals: one line each, nothing installed ---------------------------------------------------


def test_bad_values_are_refused_by_the_options_in_one_line() -> None:
    pipe = _pipe("z-image")
    for bad, match in [
        (dict(quantize="int4"), r"^quantize must be None or one of fp8; got 'int4'$"),
        (dict(quantize=True), "quantize must be None or one of fp8"),
        (dict(quantize="fp8", fp8_budget=0), r"^fp8_budget must be a relative error in \(0, 1\], got 0$"),
        (dict(quantize="fp8", fp8_budget=1.5), "fp8_budget must be a relative error"),
        (dict(quantize="fp8", fp8_budget=float("nan")), "fp8_budget must be a relative error"),
        (dict(quantize="fp8", fp8_budget=True), "fp8_budget must be a relative error"),
        (dict(quantize="fp8", parallel="cfg"), "quantize='fp8' does not combine with parallel= yet"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            accelerate_pipeline(pipe, **bad)
        _one_line(e)
        assert "accel" not in vars(pipe) and graph_hook_of(pipe.transformer) is None


def test_the_cpu_is_refused_naming_what_runs_float8() -> None:
    pipe = _pipe("z-image")
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == (
        "quantize='fp8' needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        "the denoiser is on cpu"
    )
    assert "accel" not in vars(pipe) and graph_hook_of(pipe.transformer) is None


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """A CUDA device of a chosen capability (the denoiser is taken to be on it)."""
    gpu = SimpleNamespace(capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu.name)
    monkeypatch.setattr(quantize_mod, "module_device", lambda module: torch.device("cuda", 0))
    return gpu


def test_a_gpu_below_sm89_is_refused_naming_its_capability(fake_gpu) -> None:
    pipe = _pipe("z-image")
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == (
        "quantize='fp8' needs a CUDA GPU of compute capability 8.9 or newer; cuda:0 (NVIDIA A100-SXM4-80GB) "
        "has compute capability 8.0"
    )
    assert "accel" not in vars(pipe) and graph_hook_of(pipe.transformer) is None
    for capability in [(8, 9), (9, 0), (10, 0)]:
        fake_gpu.capability = capability
        check_fp8_device(torch.device("cuda", 0))  # Ada, Hopper, Blackwell pass


def test_missing_torchao_is_refused_naming_the_extra(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu.capability = (9, 0)
    monkeypatch.setattr(quantizers, "_torchao_version", lambda: None)
    pipe = _pipe("z-image")
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == "quantize='fp8' needs torchao: pip install 'bcg-diffusers[fp8]'"
    assert "accel" not in vars(pipe)


def test_weights_that_are_not_bf16_are_refused(fake_gpu) -> None:
    pytest.importorskip("torchao")
    fake_gpu.capability = (9, 0)
    pipe = _pipe("z-image")  # tiny pipelines are float32
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == (
        "quantize='fp8' (per-row float8) needs bfloat16 weights; ZImageTransformer2DModel's are float32: "
        "load it with torch_dtype=torch.bfloat16"
    )


def test_weights_another_library_quantized_are_refused_and_reported_without_quantize(monkeypatch) -> None:
    use_grid(monkeypatch)
    pipe = _pipe("z-image")
    pipe.transformer.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == (
        "transformer was quantized when loaded (bitsandbytes): quantize='fp8' needs its bf16 weights; "
        "pass quantize=None to run it as it is"
    )
    accelerate_pipeline(pipe)
    assert "  transformer: quantized when loaded (bitsandbytes): used as it is, not measured" in pipe.accel.report()


# -- the selection, against the stand-in ----------------------------------------------------------


def _select(pipe, quantizer: GridQuantizer, budget: float, run=None):
    run = run or (lambda: generate(pipe, steps=2, guidance=4.0, negative_prompt="blurry"))
    keep = {"transformer": QwenImageRecipe.fp8_keep}
    return select_layers({"transformer": pipe.transformer}, quantizer, keep, run, budget)


def test_the_worst_layers_go_back_to_bf16_until_the_latents_are_within_budget() -> None:
    pipe = _pipe()
    run = lambda: generate(pipe, steps=2, guidance=4.0, negative_prompt="blurry")  # noqa: E731
    ref = run()
    before = _linears(pipe.transformer)
    weights = {n: m.weight for n, m in before.items()}
    budget = 0.01
    sel = _select(pipe, GridQuantizer(levels=64, coarse={COARSE: 1}), budget, run)

    assert sel.kept_by_recipe == QWEN_KEPT and sel.not_taken == ()
    assert sel.kept_measured[0] == COARSE and max(sel.errors, key=sel.errors.get) == COARSE
    assert sel.all_quantized_error > budget >= sel.error
    assert len(sel.quantized) + len(sel.kept_measured) + len(QWEN_KEPT) == len(before) == 34
    after = _linears(pipe.transformer)
    for name in sel.quantized:
        assert type(after[name]) is GridLinear
    for name in (*sel.kept_by_recipe, *sel.kept_measured):  # the very bf16 layers and weights
        assert after[name] is before[name] and after[name].weight is weights[name]
    assert distance(run(), ref) == (sel.error, sel.max_abs)  # the state left is the state measured
    assert sel.bytes_after < sel.bytes_before


def test_the_selection_repeats_bit_for_bit() -> None:
    a = _select(_pipe(), GridQuantizer(levels=16, coarse={COARSE: 1}), 0.02)
    b = _select(_pipe(), GridQuantizer(levels=16, coarse={COARSE: 1}), 0.02)
    assert a == b and a.kept_measured and a.errors[COARSE] > 0.5


def test_a_loose_budget_quantizes_every_candidate_after_two_calls() -> None:
    sel = _select(_pipe(), GridQuantizer(levels=64), 1.0)
    assert sel.kept_measured == () and sel.runs == 2 and len(sel.quantized) == 16


def test_a_layer_whose_float8_product_the_device_refuses_stays_in_bf16(caplog) -> None:
    pipe = _pipe()
    run = lambda: generate(pipe, steps=2, guidance=4.0, negative_prompt="blurry")  # noqa: E731
    ref = run()
    before = _linears(pipe.transformer)
    refused = "transformer_blocks.0.img_mlp.net.2"
    with caplog.at_level(logging.WARNING, logger="accel.hooks.fp8.layer_select"):
        sel = _select(pipe, GridQuantizer(levels=64, refused=[refused]), 1.0, run)
    assert refused in sel.not_taken and refused not in sel.quantized and refused not in sel.errors
    assert len(sel.quantized) == 15 and sel.runs == 2
    after = _linears(pipe.transformer)
    assert after[refused] is before[refused] and type(after[refused]) is torch.nn.Linear
    assert all(type(after[n]) is GridLinear for n in sel.quantized)
    [line] = [r.getMessage() for r in caplog.records if "refused the float8 product" in r.getMessage()]
    assert refused in line and "CUBLAS_STATUS_NOT_SUPPORTED" in line and "bf16" in line
    assert distance(run(), ref) == (sel.error, sel.max_abs)  # what was measured is what runs


def test_a_failure_while_selecting_puts_every_layer_back_in_bf16() -> None:
    pipe = _pipe()
    run = lambda: generate(pipe, steps=2, guidance=4.0, negative_prompt="blurry")  # noqa: E731
    ref = run()
    before = {n: (m, m.weight, dict(vars(m))) for n, m in _linears(pipe.transformer).items()}
    calls = []

    def failing() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory, say")
        return run()

    with pytest.raises(RuntimeError, match="out of memory"):
        _select(pipe, GridQuantizer(levels=4), 0.001, failing)
    for name, m in _linears(pipe.transformer).items():
        module, weight, attrs = before[name]
        assert m is module and m.weight is weight and vars(m).keys() == attrs.keys()
    assert torch.equal(run(), ref)


# -- through accelerate_pipeline and the warm-up ----------------------------------------------------


def test_the_warmup_selects_and_the_report_says_so_the_same_every_time(monkeypatch) -> None:
    reports = []
    for _ in range(2):
        made = use_grid(monkeypatch, levels=64, coarse={COARSE: 1})
        pipe = _pipe()
        accelerate_pipeline(pipe, quantize="fp8", fp8_budget=0.01)
        assert "nothing quantized yet: the first warmup(...) measures the layers" in pipe.accel.report()
        pipe.accel.warmup((64, 64), prompts=["a fox"], progress=False)
        sel = pipe.accel.quantization.selection
        assert sel is not None and made[0].calls and sel.kept_measured[0] == COARSE
        lines = [line for line in pipe.accel.report().splitlines() if "quantize" in line or line.startswith("    ")]
        reports.append(pipe.accel.quantization.describe())
        assert any("Linear layers in float8" in line for line in lines)
        pipe.accel.warmup((64, 64), prompts=["a fox"], progress=False)  # a second warm-up measures nothing
        assert len(made[0].calls) == 1 and pipe.accel.quantization.selection is sel
    assert reports[0] == reports[1]
    head, latents, weights = reports[0]
    kept = len(QWEN_KEPT) + len(sel.kept_measured)
    assert head.startswith(
        f"  quantize fp8 (stand-in grid: weights and activations rounded per row): {len(sel.quantized)} of 34 "
        f"Linear layers in float8; {kept} kept in bf16 ({len(QWEN_KEPT)} named by the recipe, {len(sel.kept_measured)} "
        f"measured worst ({COARSE}"
    )
    assert head.endswith("; 0 it cannot take")
    assert latents.startswith(f"    final latents {sel.error:.2%} from bf16") and "budget 1.00%" in latents
    assert "measured at the first warm-up call (64x64, batch 1, guidance on, 2 steps;" in latents
    assert weights.startswith("    denoiser weights ") and " MiB -> " in weights
    assert pipe.accel.quantization.summary() == (
        f"fp8 (stand-in grid): {len(sel.quantized)} Linear layers in float8, {kept} in bf16; "
        f"final latents {sel.error:.2%} from bf16 (budget 1.00%)"
    )


def _measured_guidance(monkeypatch, name: str, **warmup) -> list[float]:
    """The guidance scales of the calls the first warm-up measured ``name``'s layers on."""
    use_grid(monkeypatch, levels=64)
    pipe = _pipe(name)
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=1.0)
    measured: list[float] = []
    calibrate = quantize_mod.Quantization.calibrate

    def recording(self, pipe, kwargs, *args, **kw):
        measured.append(kwargs.get("guidance_scale", kwargs.get("true_cfg_scale")))
        return calibrate(self, pipe, kwargs, *args, **kw)

    monkeypatch.setattr(quantize_mod.Quantization, "calibrate", recording)
    pipe.accel.warmup((32, 32), batch_sizes=[2, 1], progress=False, **warmup)
    assert pipe.accel.quantization.selection is not None
    return measured


def test_the_measured_call_runs_the_guidance_the_calls_will(monkeypatch) -> None:
    """Guidance multiplies the float8 error into the latents: where the warm-up takes both settings,
    the measured call is the recipe's usual one (Z-Image: none, Qwen-Image: true CFG), or the one
    ``measure_cfg`` names; with one setting, that one."""
    assert _measured_guidance(monkeypatch, "z-image", cfg=[True, False]) == [0.0]
    assert _measured_guidance(monkeypatch, "z-image", cfg=[True, False], measure_cfg=True) == [4.0]
    assert _measured_guidance(monkeypatch, "z-image") == [4.0]  # cfg=True, the warm-up's default
    assert _measured_guidance(monkeypatch, "qwen-image", cfg=[False, True]) == [4.0]  # true_cfg_scale
    assert _measured_guidance(monkeypatch, "qwen-image", cfg=[False, True], measure_cfg=False) == [1.0]
    pipe = _pipe("z-image")
    use_grid(monkeypatch)
    accelerate_pipeline(pipe, quantize="fp8")
    for bad, match in [(dict(cfg=False, measure_cfg=True), r"^measure_cfg=True: the warm-up was asked for cfg=\[False\] only$"),
                       (dict(measure_cfg="yes"), "^measure_cfg must be None, True or False, got 'yes'$")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            pipe.accel.warmup((32, 32), progress=False, **bad)
    assert pipe.accel.quantization.pending  # refused before anything ran


def test_a_selection_that_keeps_every_layer_in_bf16_says_so(monkeypatch, caplog) -> None:
    use_grid(monkeypatch, levels=1)  # one level per sign: no layer in float8 is within the budget
    pipe = _pipe("z-image")
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=1e-6)
    with caplog.at_level(logging.WARNING, logger="accel.hooks.fp8.quantize"):
        pipe.accel.warmup((32, 32), cfg=False, progress=False)
    sel = pipe.accel.quantization.selection
    assert sel.quantized == () and sel.kept_measured
    [line] = [r.getMessage() for r in caplog.records if "every Linear layer stays in bf16" in r.getMessage()]
    assert "(32x32, batch 1, guidance off, 2 steps)" in line and "fp8_budget" in line and "measure_cfg" in line


def test_before_a_warmup_nothing_changes_and_that_is_said_once(monkeypatch, caplog) -> None:
    use_grid(monkeypatch)
    pipe = _pipe()
    want = generate(pipe)
    accelerate_pipeline(pipe, quantize="fp8")
    with caplog.at_level(logging.WARNING):
        got = [generate(pipe), generate(pipe)]
    said = [r.getMessage() for r in caplog.records if "nothing is quantized until warmup" in r.getMessage()]
    assert len(said) == 1 and all(torch.equal(g, want) for g in got)
    assert pipe.accel.quantization.summary() == "fp8 requested, not applied yet (no warm-up): bf16"
    assert not any(isinstance(m, GridLinear) for m in pipe.transformer.modules())
    pipe.accel.restore()  # nothing was quantized: exactly as it was
    assert torch.equal(generate(pipe), want)


def test_restore_leaves_the_float8_layers_and_an_accelerator_after_it_uses_them_as_they_are(
    monkeypatch, caplog
) -> None:
    made = use_grid(monkeypatch, levels=64)
    pipe = _pipe()
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=0.5)
    pipe.accel.warmup((64, 64), progress=False)
    quantized = pipe.accel.quantization.selection.quantized
    out = generate(pipe)
    with caplog.at_level(logging.WARNING):
        pipe.accel.restore()
    assert any(f"restore(): {len(quantized)} Linear layers of transformer stay in float8" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    layers = _linears(pipe.transformer)
    assert all(type(layers[n]) is GridLinear for n in quantized)
    assert torch.equal(generate(pipe), out)  # what ran stays what runs
    accelerate_pipeline(pipe, quantize="fp8")
    assert not pipe.accel.quantization.pending
    pipe.accel.warmup((64, 64), progress=False)
    assert len(made) == 2 and made[1].calls == []  # not measured, not quantized again
    assert (
        "  transformer: quantized by an earlier quantize='fp8' (stand-in grid): used as it is, not measured"
    ) in pipe.accel.report()


def test_a_step_cache_under_graphs_on_the_quantized_model_equals_it_run_eagerly(monkeypatch) -> None:
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    from tests.helpers.emulator import emulate_pipelines

    emulate_pipelines(monkeypatch)
    use_grid(monkeypatch, levels=16)
    pipe = _pipe()
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=10.0))  # caches every step it may
    accelerate_pipeline(pipe, quantize="fp8", capture_on_miss=True, text_encoder=False, vae=False)
    pipe.accel.warmup((64, 64), prompts=["a fox"], negative_prompt="blurry", progress=False)
    assert pipe.accel.quantization.selection.quantized
    cases = [dict(seed=1), dict(seed=0)]
    kw = dict(prompt="a fox", steps=3, guidance=4.0, negative_prompt="blurry")
    got = [generate(pipe, **kw, **case) for case in cases]
    hook = pipe.accel.hooks["transformer"]
    st = pipe.accel.stats()["transformer"]
    assert hook.active and hook.caches.active and st.replays > 0 and st.eager_calls == 0
    assert hook.caches.rules[0].counts.total_steps[1] > 0  # steps were cached
    pipe.accel.restore()  # the float8 layers stay: the eager reference runs the same model
    accelerate_pipeline(pipe, mode="eager")
    want = [generate(pipe, **kw, **case) for case in cases]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"


def test_candidates_leave_out_the_recipes_layers_peft_and_what_the_quantizer_cannot_take() -> None:
    from accel.hooks.fp8.layer_select import candidates

    class LoraLinear(torch.nn.Module):  # PEFT's shape: the wrapped layer and the adapter's own
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = torch.nn.Linear(32, 32)
            self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(32, 4)})
            self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 32)})

    class Small(GridQuantizer):
        def takes(self, linear: torch.nn.Linear) -> bool:
            return linear.in_features % 16 == 0

    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Linear(8, 32),
            "blocks": torch.nn.ModuleList(
                [torch.nn.ModuleDict({"mod": torch.nn.Linear(32, 96), "ff": torch.nn.Linear(32, 32)})]
            ),
            "odd": torch.nn.Linear(24, 32),
            "proj": LoraLinear(),
        }
    )
    chosen, kept, not_taken = candidates(model, Small(), ("embed", "*.mod"))
    assert kept == ["embed", "blocks.0.mod"]
    assert chosen == ["blocks.0.ff"]
    assert not_taken == ["odd", "proj.base_layer", "proj.lora_A.default", "proj.lora_B.default"]


def test_each_model_gets_the_kind_of_float8_layer_its_recipe_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.hooks.fp8 import layer_kinds
    from accel.hooks.fp8.layer_kinds import quantizer_for

    made: list[str] = []

    def kind(name: str):
        def make() -> GridQuantizer:
            made.append(name)
            return GridQuantizer()

        return make

    monkeypatch.setattr(layer_kinds, "FP8_LAYERS", {k: kind(k) for k in layer_kinds.FP8_LAYERS})
    monkeypatch.setitem(quantizers.QUANTIZERS, "fp8", kind("quantize='fp8' itself"))
    for name in ("qwen-image", "z-image"):
        accelerate_pipeline(_pipe(name), quantize="fp8")
    assert made == ["scaled-mm", "quantize='fp8' itself"]  # Qwen-Image names the library's; Z-Image none
    with pytest.raises(ValueError, match="float8 layers must be one of torchao, scaled-mm; got 'int4'"):
        quantizer_for("fp8", "int4")


def test_the_library_float8_layers_refuse_weights_that_are_not_bf16(fake_gpu) -> None:
    fake_gpu.capability = (9, 0)
    pipe = _pipe("qwen-image")  # tiny pipelines are float32; Qwen-Image's recipe names the library's layers
    with pytest.raises(QuantizeError) as e:
        accelerate_pipeline(pipe, quantize="fp8")
    assert _one_line(e) == (
        "quantize='fp8' (per-row float8) needs bfloat16 weights; QwenImageTransformer2DModel's are float32: "
        "load it with torch_dtype=torch.bfloat16"
    )
    assert "accel" not in vars(pipe)
