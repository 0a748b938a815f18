"""accelerate_pipeline on tiny offline pipelines, on the CPU: the install plan, restore, errors, recipes."""

from __future__ import annotations

import gc
import itertools
import logging

import pytest
import torch
from diffusers import DiffusionPipeline

import accel.hooks.recipes.registry as recipe_mod
from accel import accelerate_pipeline
from accel.hooks.accelerator import HOOK_NAME
from accel.hooks.recipes.generic import GenericRecipe
from accel.hooks.recipes.recipe import Recipe, WarmupCase
from accel.hooks.recipes.registry import recipe_for
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image.recipe import QwenImageRecipe
from pipelines.families.z_image.recipe import ZImageRecipe
from tests.helpers.generate import generate

MODELS = ["z-image", "qwen-image"]


def _call(pipe, name: str, seed: int = 0, **extra) -> torch.Tensor:
    prompt = "a lighthouse on a cliff in a storm"
    return generate(pipe, prompt, size=(96, 64), negative_prompt="blurry", guidance=4.0, seed=seed, **extra)


@pytest.fixture(params=MODELS)
def tiny(request):
    pipe = build_pipeline(request.param, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe


def test_the_plan_finds_denoiser_and_recipe(tiny) -> None:
    name, pipe = tiny
    accelerate_pipeline(pipe)
    assert list(pipe.accel.runners) == ["transformer", "text_encoder", "vae.decoder"]  # denoisers first
    expected = QwenImageRecipe if name == "qwen-image" else ZImageRecipe
    assert isinstance(pipe.accel.recipes["transformer"], expected)
    assert getattr(pipe.scheduler.step, "__bcg_eager__", False)
    # the module is still the module
    assert pipe.transformer.config is not None and pipe.transformer.dtype == torch.float32


def test_cpu_calls_equal_eager_exactly(tiny) -> None:
    name, pipe = tiny
    ref = _call(pipe, name)
    accelerate_pipeline(pipe)
    out = _call(pipe, name)
    assert torch.equal(out, ref)
    st = pipe.accel.stats()["transformer"]
    assert st.eager_calls == (4 if name == "qwen-image" else 2) and st.captures == 0 and st.replays == 0


def test_idempotent_and_restore_gives_back_the_original(tiny) -> None:
    name, pipe = tiny
    module = pipe.transformer
    had_registry = hasattr(module, "_diffusers_hook")
    had_forward = "forward" in module.__dict__
    original_forward = module.forward
    accelerate_pipeline(pipe)
    first = pipe.accel
    assert accelerate_pipeline(pipe) is pipe and pipe.accel is first
    assert list(module._diffusers_hook.hooks) == [HOOK_NAME]
    accelerate_pipeline(pipe, mode="debug")  # other options re-install, still one hook
    assert pipe.accel is not first and list(module._diffusers_hook.hooks) == [HOOK_NAME]
    restored = pipe.accel.restore()
    assert restored is pipe and "accel" not in pipe.__dict__
    assert module.forward == original_forward
    assert ("forward" in module.__dict__) == had_forward
    assert hasattr(module, "_diffusers_hook") == had_registry
    assert "step" not in vars(pipe.scheduler)
    ref = _call(pipe, name)
    accelerate_pipeline(pipe)  # works again after a restore
    assert torch.equal(_call(pipe, name), ref)


def test_debug_and_eager_modes_equal_stock(tiny) -> None:
    name, pipe = tiny
    ref = _call(pipe, name)
    for mode in ("debug", "eager"):
        accelerate_pipeline(pipe, mode=mode)
        assert pipe.accel.mode == mode
        assert torch.equal(_call(pipe, name), ref), mode
    assert pipe.accel.runners["transformer"].enabled is False  # eager mode never captures


def test_warmup_on_cpu_captures_nothing_and_validates_input(tiny) -> None:
    _, pipe = tiny
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup([(64, 64), (128, 96)], progress=False)
    assert [(r.width, r.height) for r in report.rows] == [(128, 96), (64, 64)]  # largest first
    assert (
        report.total_captures == 0 and "CUDA is not available" in str(report) == f"nothing captured: {report.skipped}"
    )
    for bad in [(100, 64), (0, 64), (64,), "512x512"]:
        with pytest.raises(ValueError):
            pipe.accel.warmup([bad], progress=False)
    with pytest.raises(ValueError, match="not both"):
        pipe.accel.warmup((64, 64), prompts=["a"], prompt_lengths=[8])
    with pytest.raises(ValueError):
        pipe.accel.warmup((64, 64), batch_sizes=(0,))


def test_bad_pipelines_and_options_are_refused() -> None:
    with pytest.raises(TypeError, match="DiffusionPipeline"):
        accelerate_pipeline(torch.nn.Linear(2, 2))

    class NoDenoiser(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)

    with pytest.raises(ValueError, match="no denoiser"):
        accelerate_pipeline(NoDenoiser(torch.nn.Linear(2, 2)))
    pipe = build_pipeline("z-image", "tiny")
    with pytest.raises(ValueError, match="mode"):
        accelerate_pipeline(pipe, mode="fast")
    assert "accel" not in pipe.__dict__


def test_unknown_diffusers_version_falls_back_to_eager(monkeypatch, caplog) -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    ref = _call(pipe, "z-image")
    monkeypatch.setattr(ZImageRecipe, "diffusers_versions", "<0.1")
    with caplog.at_level(logging.WARNING, logger="accel.hooks.accelerator"):
        accelerate_pipeline(pipe)
    assert "tested with diffusers <0.1" in caplog.text
    assert pipe.accel.runners["transformer"].enabled is False
    assert "_pad_with_ids" not in pipe.transformer.__dict__  # the recipe did not touch the model
    assert torch.equal(_call(pipe, "z-image"), ref)


def test_recipe_lookup_by_class_and_registry(monkeypatch) -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    assert recipe_for(pipe.transformer) is QwenImageRecipe
    assert recipe_for(torch.nn.Linear(2, 2)) is GenericRecipe

    class MyDenoiser(torch.nn.Module):
        pass

    class MyRecipe(Recipe):
        name = "mine"
        denoiser_classes = ("MyDenoiser",)

    monkeypatch.setattr(recipe_mod, "_registry", list(recipe_mod._registry))
    recipe_mod.register_recipe(MyRecipe)
    assert recipe_for(MyDenoiser()) is MyRecipe
    with pytest.raises(TypeError):
        recipe_mod.register_recipe(object)  # type: ignore[arg-type]


# --- padding equivalence of each recipe on a transformer forward ---------------------------
@torch.no_grad()
def test_zimage_caption_padding_is_bit_exact() -> None:
    module = build_pipeline("z-image", "tiny").transformer
    recipe = ZImageRecipe()
    g = torch.Generator().manual_seed(0)
    for lengths in [(37, 10), (32, 1), (64, 63), (5,)]:
        x = [torch.randn(16, 1, 8, 12, generator=g) for _ in lengths]
        t = torch.rand(len(lengths), generator=g)
        caps = [torch.randn(n, module.config.cap_feat_dim, generator=g) for n in lengths]
        ref = module(x, t, caps, return_dict=False)[0]
        undo = recipe.install(module)
        try:
            args, kwargs = recipe.prepare((x, t, caps), {"return_dict": False})
            assert [c.shape[0] for c in args[2]] == [-(-n // 32) * 32 for n in lengths]
            out = recipe.wrap_forward(module.forward)(*args, **kwargs)[0]
        finally:
            undo()
        for o, r in zip(out, ref):
            assert torch.equal(o, r), lengths
    assert "_pad_with_ids" not in module.__dict__


@torch.no_grad()
def test_zimage_lengths_in_one_multiple_of_32_share_a_signature() -> None:
    from accel.graphs.signature import flatten

    recipe = ZImageRecipe()
    x, t = [torch.randn(16, 1, 8, 8)], torch.rand(1)
    keys = {flatten(*recipe.prepare((x, t, [torch.randn(n, 32)]), {}))[0].key for n in (33, 40, 64)}
    assert len(keys) == 1
    assert flatten(*recipe.prepare((x, t, [torch.randn(65, 32)]), {}))[0].key not in keys


@torch.no_grad()
def test_qwen_text_buckets_pad_with_a_zero_mask_and_stay_close() -> None:
    module = build_pipeline("qwen-image", "tiny").transformer
    recipe = QwenImageRecipe()
    g = torch.Generator().manual_seed(0)
    undo = recipe.install(module)
    try:
        for length in (7, 64, 100):
            kw = dict(
                hidden_states=torch.randn(1, 4 * 6, 64, generator=g),
                encoder_hidden_states=torch.randn(1, length, module.config.joint_attention_dim, generator=g),
                encoder_hidden_states_mask=None,
                timestep=torch.rand(1, generator=g),
                img_shapes=[[(1, 4, 6)]],
                return_dict=False,
            )
            ref = module(**kw)[0]
            _, padded = recipe.prepare((), kw)
            bucket = recipe.bucket(length)
            assert padded["encoder_hidden_states"].shape[1] == bucket
            mask = padded["encoder_hidden_states_mask"]
            assert mask[0, :length].all() and not mask[0, length:].any()
            out = module(**padded)[0]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    finally:
        undo()
    assert (
        QwenImageRecipe(text_buckets=None)
        .prepare((), {"encoder_hidden_states": torch.zeros(1, 7, 4)})[1]["encoder_hidden_states"]
        .shape[1]
        == 7
    )


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_warmup_calls_hit_the_signatures_of_real_calls(name: str) -> None:
    """What warm-up captures must be exactly what real calls look like to the runner."""
    from accel.graphs.signature import flatten

    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    recipe = (QwenImageRecipe if name == "qwen-image" else ZImageRecipe)()
    recipe.install(pipe.transformer)
    seen: list = []
    original = pipe.transformer.forward

    def record(*args, **kwargs):
        seen.append(flatten(*recipe.prepare(args, kwargs))[0].key)
        return original(*args, **kwargs)

    pipe.transformer.forward = record
    prompt, negative = "a red fox in fresh snow at dawn", "blurry"
    for cfg, batch in itertools.product((True, False), (1, 2)):
        seen.clear()
        guidance = (
            dict(true_cfg_scale=4.0 if cfg else 1.0)
            if name == "qwen-image"
            else dict(guidance_scale=4.0 if cfg else 0.0)
        )
        pipe(
            prompt=prompt,
            negative_prompt=negative if cfg else None,
            width=96,
            height=64,
            num_inference_steps=2,
            num_images_per_prompt=batch,
            output_type="latent",
            **guidance,
        )
        real = set(seen)
        seen.clear()
        length = recipe.warmup_length(recipe.prompt_lengths(pipe, [prompt])[0], 96, 64)
        negative_length = recipe.prompt_lengths(pipe, [negative])[0]
        case = WarmupCase(96, 64, batch, cfg, length, num_inference_steps=2, negative_prompt_length=negative_length)
        for kwargs in recipe.warmup_calls(pipe, case):
            pipe(**kwargs)
        assert set(seen) == real, (cfg, batch)


def test_api_arguments_are_validated_in_one_clear_line() -> None:
    pipe = build_pipeline("z-image", "tiny")
    for bad, match in [
        (dict(memory_budget_mb=-1), "memory_budget_mb must be a positive number"),
        (dict(memory_budget_mb=float("nan")), "memory_budget_mb"),
        (dict(max_entries=0), "max_entries must be a positive integer"),
        (dict(capture_on_miss="yes"), "capture_on_miss must be True or False"),
        (dict(text_buckets="64"), "text_buckets must be a sequence"),
        (dict(text_buckets=[64, 0]), "every text bucket must be a positive integer"),
        (dict(mode="fast"), "mode must be one of bcg, debug, eager"),
        (dict(compile="no"), "compile must be True or False"),
    ]:
        with pytest.raises(ValueError, match=match):
            accelerate_pipeline(pipe, **bad)
        assert "accel" not in vars(pipe)
    accelerate_pipeline(pipe)
    for bad, match in [
        (dict(cfg="maybe"), "cfg must be True, False or a list of them"),
        (dict(batch_sizes=[1.5]), "batch_sizes must be a list of positive integers"),
        (dict(prompt_lengths=[True]), "prompt_lengths must be a list of positive integers"),
        (dict(num_inference_steps=1), "num_inference_steps must be an integer of at least 2"),
        (dict(prompts=[3]), "prompts must be a list of strings"),
    ]:
        with pytest.raises(ValueError, match=match):
            pipe.accel.warmup((64, 64), progress=False, **bad)
    for bad in ["512x512", (512.5, 512), (True, 16), [(64,)], 64]:
        with pytest.raises(ValueError, match="resolution"):
            pipe.accel.warmup(bad, progress=False)


def test_the_options_object_is_the_api_and_keywords_override_its_fields() -> None:
    import dataclasses

    from accel import AcceleratorOptions

    pipe = build_pipeline("z-image", "tiny")
    accelerate_pipeline(pipe, AcceleratorOptions(mode="debug", max_entries=4))
    assert (pipe.accel.options.mode, pipe.accel.options.max_entries) == ("debug", 4)
    accelerate_pipeline(pipe, AcceleratorOptions(mode="debug"), max_entries=5, text_buckets=[128, 64])
    assert pipe.accel.options == AcceleratorOptions(mode="debug", max_entries=5, text_buckets=(64, 128))
    accelerate_pipeline(pipe, compile_cache_dir="~/kernels")
    assert pipe.accel.options.compile_cache_dir.name == "kernels" and "~" not in str(
        pipe.accel.options.compile_cache_dir
    )
    fields = [f.name for f in dataclasses.fields(AcceleratorOptions)]
    with pytest.raises(
        TypeError, match=r"^unknown options 'modee', 'turbo'; the options \(fields of AcceleratorOptions\) are "
    ) as e:
        accelerate_pipeline(pipe, modee="eager", turbo=True)
    assert str(e.value).endswith(", ".join(fields))
    with pytest.raises(TypeError, match="options must be an AcceleratorOptions, got dict"):
        accelerate_pipeline(pipe, {"mode": "eager"})  # type: ignore[arg-type]
    assert pipe.accel.options.compile_cache_dir is not None  # the accelerator in place stays
    pipe.accel.restore()


def test_every_option_is_documented_on_the_dataclass() -> None:
    import dataclasses

    from accel import AcceleratorOptions

    doc = AcceleratorOptions.__doc__ or ""
    missing = [f.name for f in dataclasses.fields(AcceleratorOptions) if f"        {f.name}: " not in doc]
    assert not missing, f"AcceleratorOptions does not document {missing}"


def test_restore_twice_is_harmless_and_a_restored_accelerator_says_so(tiny) -> None:
    _, pipe = tiny
    accelerate_pipeline(pipe)
    accel = pipe.accel
    assert accel.restore() is pipe
    assert accel.restore() is pipe  # a bare AttributeError before
    assert "restored" in accel.report()
    with pytest.raises(RuntimeError, match="restored"):
        accel.warmup((64, 64), progress=False)


def test_the_report_lists_the_patches_in_place_and_restore_takes_them_all_away(tiny) -> None:
    from accel.graphs import patches

    name, pipe = tiny
    # Pipelines earlier tests dropped without restoring hold patches until the collector frees
    # them: a collection during this test (they run in another order under xdist) moved the count.
    gc.collect()
    before = patches.active()
    accelerate_pipeline(pipe)
    report = pipe.accel.report()
    assert "patches in place (process-wide):" in report
    shown = [line.strip() for line in report.splitlines()[report.splitlines().index(
        next(line for line in report.splitlines() if "patches in place" in line)) + 1 :]]  # fmt: skip
    assert shown == patches.active() and len(shown) > len(before)
    assert any(line.endswith(".step") and "call guard" in line for line in shown)  # scheduler.step
    if name == "qwen-image":
        assert any("text-mask helper" in line for line in shown)
    pipe.accel.restore()
    assert patches.active() == before


def test_qwen_pads_text_only_where_the_forward_is_launch_bound() -> None:
    from pipelines.families.qwen_image.recipe import BUCKET_MAX_IMAGE_TOKENS

    recipe = QwenImageRecipe()
    text = torch.randn(1, 40, 8)

    def padded_length(image_tokens: int) -> int:
        kwargs = dict(hidden_states=torch.randn(1, image_tokens, 64), encoder_hidden_states=text)
        return recipe.prepare((), kwargs)[1]["encoder_hidden_states"].shape[1]

    assert padded_length(32 * 32) == 64  # 512x512: bucketed
    assert padded_length(BUCKET_MAX_IMAGE_TOKENS) == 64
    assert padded_length(64 * 64) == 40  # 1024x1024: exact length, the stock kernel
    assert recipe.warmup_length(40, 512, 512) == 64 and recipe.warmup_length(40, 1024, 1024) == 40


def test_a_recompile_drops_compiled_graphs_at_the_next_call(monkeypatch) -> None:
    """Dynamo runs its newest compiled version for every shape, so graphs captured over older
    kernels are dropped (and captured again) once inductor compiled again; uncompiled modules
    and calls without a recompile keep theirs."""
    import accel.hooks.compiled.compile as compile_mod
    from accel.hooks.graph_hook import graph_hook_of

    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe)
    hooks = {name: graph_hook_of(m) for name, m in [("transformer", pipe.transformer), ("vae", pipe.vae.decoder)]}
    hooks["transformer"].compiled = True  # as compile=True on a GPU leaves it
    compiles = [5]
    monkeypatch.setattr(compile_mod, "compiled_graph_count", lambda: compiles[0])
    dropped = {name: 0 for name in hooks}
    for name, hook in hooks.items():
        monkeypatch.setattr(
            hook.runner,
            "release",
            lambda *, recapture=False, name=name: (
                (dropped.__setitem__(name, dropped[name] + 1) or 1) if recapture else 0
            ),
        )

    _call(pipe, "z-image")
    _call(pipe, "z-image")
    assert dropped == {"transformer": 0, "vae": 0}
    compiles[0] += 1  # say the last call's new shape recompiled a block
    _call(pipe, "z-image")
    assert dropped == {"transformer": 1, "vae": 0}
    _call(pipe, "z-image")
    assert dropped == {"transformer": 1, "vae": 0}
    assert (hooks["transformer"].recompile_drops, hooks["vae"].recompile_drops) == (1, 0)
    assert "graphs dropped by 1 recompiles" in pipe.accel.report()
    pipe.accel.restore()
