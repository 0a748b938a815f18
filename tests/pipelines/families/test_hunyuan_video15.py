"""HunyuanVideo-1.5's recipe on a tiny random model, under emulated CUDA graphs (tests/helpers/emulator.py).

Every output is compared bit for bit with diffusers' stock forward run eagerly on the same
inputs. Inputs look like HunyuanVideo15Pipeline's: latents with the condition channels, a
timestep per sample, Qwen and ByT5 embeddings whose masks keep a different number of tokens per
sample (so the reordering moves rows), and image embeddings that are zeros for text-to-video.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap

import pytest
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)

from accel import GenericRecipe, accelerate_pipeline, register_recipe
from accel.hooks.graph_hook import GraphHook, apply_graph_runner, remove_graph_runner
from accel.hooks.options import AcceleratorOptions
from accel.hooks.recipes import registry as recipe_mod
from pipelines.families.hunyuan_video15.recipe import (
    BREAK_NAME,
    HunyuanVideo15Recipe,
    combine_condition_tokens,
    split_forward,
)
from tests.helpers.emulator import emulate_cuda, emulate_pipelines, segment_replays

TINY = dict(
    in_channels=9,  # 4 latent channels, 4 condition latents, 1 condition mask, as the pipeline stacks them
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)
BATCH, FRAMES, SIDE = 2, 2, 4
MLLM, BYT5, IMAGE = 10, 6, 5


class _User:
    """Whoever holds a graph hook (a pipeline, in the library): only needs to be weakly referable."""


def _model(seed: int = 0) -> HunyuanVideo15Transformer3DModel:
    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**TINY).eval()


def _mask(valid: list[int], length: int) -> torch.Tensor:
    # The pipeline hands masks in the transformer's dtype (encode_prompt casts them).
    return (torch.arange(length) < torch.tensor(valid)[:, None]).float()


def _inputs(seed: int, *, t2v: bool, mllm_valid: list[int], byt5_valid: list[int]) -> dict:
    g = torch.Generator().manual_seed(seed)
    image = torch.zeros(BATCH, IMAGE, TINY["image_embed_dim"])
    if not t2v:
        image = torch.randn(image.shape, generator=g)
    return dict(
        hidden_states=torch.randn(BATCH, TINY["in_channels"], FRAMES, SIDE, SIDE, generator=g),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        encoder_hidden_states=torch.randn(BATCH, MLLM, TINY["text_embed_dim"], generator=g),
        encoder_attention_mask=_mask(mllm_valid, MLLM),
        encoder_hidden_states_2=torch.randn(BATCH, BYT5, TINY["text_embed_2_dim"], generator=g),
        encoder_attention_mask_2=_mask(byt5_valid, BYT5),
        image_embeds=image,
        return_dict=False,
    )


# Same shapes, other values: text-to-video and image-to-video, valid lengths from none to all.
CASES = [
    dict(seed=1, t2v=True, mllm_valid=[7, 3], byt5_valid=[2, 0]),
    dict(seed=2, t2v=True, mllm_valid=[10, 1], byt5_valid=[6, 4]),
    dict(seed=3, t2v=False, mllm_valid=[5, 8], byt5_valid=[0, 3]),
    dict(seed=4, t2v=False, mllm_valid=[2, 10], byt5_valid=[5, 6]),
    dict(seed=5, t2v=True, mllm_valid=[9, 6], byt5_valid=[1, 2]),
]


def _stock(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def use_recipe(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """For this test only (the registry is the process's): the recipe registered, or no recipe
    for the model, even where an installed entry point names it."""
    recipe_mod._load_entry_points()
    monkeypatch.setattr(recipe_mod, "_registry", [r for r in recipe_mod._registry if r is not HunyuanVideo15Recipe])
    if on:
        register_recipe(HunyuanVideo15Recipe)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    use_recipe(monkeypatch, True)


@pytest.fixture
def unregistered(monkeypatch: pytest.MonkeyPatch) -> None:
    use_recipe(monkeypatch, False)


def _install(model: torch.nn.Module, user: _User, **options) -> GraphHook:
    return apply_graph_runner(
        model, AcceleratorOptions(capture_on_miss=True, **options), name="transformer", user=user, pool=None
    )


def _statements(fn) -> list[str]:
    """The statements of ``fn``'s body, without its docstring or imports, as normalised source."""
    (func,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    body = [s for s in func.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.unparse(s) for s in body]


def test_the_split_is_the_installed_diffusers_forward_statement_for_statement() -> None:
    stock = _statements(HunyuanVideo15Transformer3DModel.forward)
    first = stock.index("is_t2v = torch.all(image_embeds == 0)")
    last = stock.index("encoder_attention_mask = torch.stack(new_encoder_attention_mask)")
    split, combined = _statements(split_forward), _statements(combine_condition_tokens)
    assert combined == [*stock[first : last + 1], "return (encoder_hidden_states, encoder_attention_mask)"]
    assert split[:first] == stock[:first]
    assert split[first].startswith("encoder_hidden_states, encoder_attention_mask = combine_condition_tokens(")
    assert split[first + 1 :] == stock[last + 1 :]


@pytest.mark.parametrize("return_dict", [False, True])
def test_split_forward_equals_the_stock_forward_eagerly(return_dict: bool) -> None:
    model = _model()
    split = HunyuanVideo15Recipe().wrap_forward(model.forward)
    assert split is not model.forward
    for case in CASES[:4]:
        inputs = {**_inputs(**case), "return_dict": return_dict}
        with torch.no_grad():
            want, got = model(**inputs)[0], split(**inputs)[0]
        assert torch.equal(got, want), f"{case}: max diff {(got - want).abs().max()}"


def test_replays_equal_the_stock_forward_for_t2v_and_i2v_in_one_graph(monkeypatch, registered) -> None:
    emulate_cuda(monkeypatch)
    model = _model()
    inputs = [_inputs(**case) for case in CASES]
    want = [_stock(model, i) for i in inputs]
    user = _User()
    hook = _install(model, user)
    try:
        assert isinstance(hook.recipe, HunyuanVideo15Recipe) and hook.active
        with torch.no_grad():
            got = [model(**i)[0] for i in inputs]
        for case, a, b in zip(CASES, got, want):
            assert torch.equal(a, b), f"{case}: max diff {(a - b).abs().max()}"
        runner = hook.runner
        st = runner.stats(memory=False)
        assert runner.blocked == {}
        # One capture serves every call: the first captured and replayed, the rest replayed.
        assert (st.captures, st.replays, st.eager_calls, st.misses) == (1, len(CASES), 0, 0)
        assert st.segments_per_entry == [2]
        (entry,) = runner.store.entries.values()
        (chain,) = entry.tree.chains.values()
        assert chain.graph.break_names == [BREAK_NAME]
        assert segment_replays(runner) >= 2 * len(CASES)
    finally:
        remove_graph_runner(model, user)


def test_without_the_recipe_the_whole_forward_fails_to_capture(monkeypatch, unregistered) -> None:
    emulate_cuda(monkeypatch)
    model = _model()
    inputs = _inputs(**CASES[0])
    want = _stock(model, inputs)
    user = _User()
    # Automatic breaks (the default) cannot help: the sync is in the top-level forward, which is
    # never made a break.
    hook = _install(model, user)
    try:
        assert type(hook.recipe) is GenericRecipe
        with torch.no_grad():
            got = model(**inputs)[0]
        assert torch.equal(got, want)  # the failed capture's call ran eagerly
        st = hook.runner.stats(memory=False)
        assert st.captures == 0 and st.replays == 0 and st.eager_calls == 1
        (reason,) = hook.runner.blocked.values()  # the `if is_t2v:` host sync
        assert "not permitted when stream is capturing" in reason, reason
    finally:
        remove_graph_runner(model, user)


def test_restore_gives_back_the_stock_forward(monkeypatch, registered) -> None:
    emulate_cuda(monkeypatch)
    model = _model()
    inputs = _inputs(**CASES[2])
    want = _stock(model, inputs)
    user = _User()
    _install(model, user)
    with torch.no_grad():
        model(**inputs)
    assert "forward" in model.__dict__
    assert remove_graph_runner(model, user)
    assert "forward" not in model.__dict__ and not hasattr(model, "_diffusers_hook")
    assert model.forward.__func__ is HunyuanVideo15Transformer3DModel.forward
    assert torch.equal(_stock(model, inputs), want)


def test_another_diffusers_version_runs_eagerly_with_a_warning(monkeypatch, registered, caplog) -> None:
    emulate_cuda(monkeypatch)
    monkeypatch.setattr(HunyuanVideo15Recipe, "diffusers_versions", ">=99")
    model = _model()
    inputs = _inputs(**CASES[0])
    want = _stock(model, inputs)
    user = _User()
    with caplog.at_level(logging.WARNING):
        hook = _install(model, user)
    try:
        assert not hook.active and "tested with diffusers >=99" in hook.inactive_reason
        assert any("running HunyuanVideo15Transformer3DModel eagerly" in r.getMessage() for r in caplog.records)
        assert torch.equal(_stock(model, inputs), want)
        assert hook.runner.stats(memory=False).captures == 0
    finally:
        remove_graph_runner(model, user)


def test_a_forward_other_than_diffusers_own_is_not_split(caplog) -> None:
    class Custom(HunyuanVideo15Transformer3DModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    model = Custom(**TINY).eval()
    with caplog.at_level(logging.WARNING):
        fn = HunyuanVideo15Recipe().wrap_forward(model.forward)
    assert fn == model.forward
    assert any("not splitting it" in r.getMessage() for r in caplog.records)


def test_generation_defaults_are_the_pipelines_own() -> None:
    recipe = HunyuanVideo15Recipe()
    params = inspect.signature(HunyuanVideo15Pipeline.__call__).parameters
    defaults = recipe.generation_defaults()
    assert defaults.steps == params["num_inference_steps"].default
    # The guider holds the scale: there is no argument to name, nor a scale to override.
    assert not any("guidance" in p for p in params)
    assert defaults.guidance_kwarg is None and defaults.guidance is None
    reason = recipe.cfg_parallel_support(_model())
    assert isinstance(reason, str) and "\n" not in reason


def _pipeline() -> HunyuanVideo15Pipeline:
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(32,) * 5, layers_per_block=1)
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=_model(),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.set_progress_bar_config(disable=True)
    # What the pipeline pads each stream to (1000, 256 and 729 tokens), at the tiny model's scale.
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens = MLLM, BYT5, IMAGE
    return pipe


def _embeddings(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for prefix, valid, valid_2 in (("", 7, 3), ("negative_", 2, 0)):
        out[f"{prefix}prompt_embeds"] = torch.randn(1, MLLM, TINY["text_embed_dim"], generator=g)
        out[f"{prefix}prompt_embeds_mask"] = _mask([valid + seed % 3], MLLM)
        out[f"{prefix}prompt_embeds_2"] = torch.randn(1, BYT5, TINY["text_embed_2_dim"], generator=g)
        out[f"{prefix}prompt_embeds_mask_2"] = _mask([valid_2 + seed % 2], BYT5)
    return out


def test_pipeline_warmed_up_replays_equal_eager(monkeypatch, registered) -> None:
    emulate_pipelines(monkeypatch)
    pipe = _pipeline()

    def call(seed: int) -> torch.Tensor:
        # The pipeline's default frame count, which the warm-up (given none) captures too.
        return pipe(
            height=64,
            width=64,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(seed),
            output_type="latent",
            **_embeddings(seed),
        ).frames

    want = [call(seed) for seed in (0, 1)]
    accelerate_pipeline(pipe, vae=False)
    try:
        assert isinstance(pipe.accel.hooks["transformer"].recipe, HunyuanVideo15Recipe)
        pipe.accel.warmup([(64, 64)], progress=False)
        captured = pipe.accel.stats()["transformer"]
        assert captured.captures >= 1
        got = [call(seed) for seed in (0, 1)]
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"
        st = pipe.accel.stats()["transformer"]
        # Both guidance branches of both calls replayed the warm-up's graph: 2 calls x 2 steps x 2.
        assert st.misses == 0 and st.eager_calls == captured.eager_calls and st.captures == captured.captures
        assert st.replays - captured.replays == 8
    finally:
        pipe.accel.restore()
