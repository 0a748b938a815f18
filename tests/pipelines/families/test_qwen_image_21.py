"""Qwen-Image 2.1's recipe on the tiny random pipeline, under emulated CUDA graphs (tests/helpers/emulator.py).

Every output is compared bit for bit with the stock pipeline (or diffusers' stock forward) run
eagerly on the same inputs: text-to-image and with a condition image (through the Qwen3-VL
processor), with and without true CFG, the K/V cache off and on, the SDPA and the flex prefill.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    QwenImage21FlexAttnProcessor,
    QwenImage21KVCache,
)
from PIL import Image

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image_21.layout import LayoutMemo, layout_forward
from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe
from tests.helpers.after_warmup import as_on_cuda
from tests.helpers.emulator import emulate_pipelines

pytestmark = pytest.mark.usefixtures("few_threads")

SIDE = 64  # 4x4 latent tokens: one vision slot per 2x2
STEPS = 2
CACHED_STEPS = 6  # TaylorSeer caches from step 2, every third step
PROMPTS = ("a red fox in the snow", "a cat", "a lighthouse on a cliff at dusk, oil painting")


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # As on a GPU: the recipe's per-call routing (the masks' layout token) runs too.
    as_on_cuda(monkeypatch)
    return monkeypatch


def _pipe():
    pipe = build_pipeline("qwen-image-2.1", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _condition_image(seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(48, SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _seeds(n: int) -> list[int]:
    return [int(s) for s in np.random.default_rng().integers(1, 2**31, size=n)]


# --------------------------------------------------------------------------------------------
# The forward alone, against diffusers' own
# --------------------------------------------------------------------------------------------
def _forward_inputs(g: torch.Generator, *, condition: bool, padded: bool, batch: int = 2) -> dict:
    """A call as the pipeline makes one: text with a vision slot run inside it (a condition
    image's 2x2 latent tokens) where ``condition``, the target image's slots last; a text mask
    keeping fewer tokens of the second sample where ``padded``."""
    text, cond_slots, target = 9, 2, 16
    img_mask = torch.zeros(batch, text + target // 4, dtype=torch.bool)
    img_mask[:, text:] = True
    shapes = [(1, 4, 4)]
    if condition:
        img_mask[:, 3 : 3 + cond_slots] = True
        shapes = [(1, 2, 4), *shapes]
    latent = sum(f * h * w for f, h, w in shapes)
    kwargs = dict(
        hidden_states=torch.randn(batch, latent, 8, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_shapes=[shapes] * batch,
        img_mask=img_mask,
        return_dict=False,
    )
    if padded:
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[-1, -3:] = 0
        kwargs["encoder_hidden_states_mask"] = mask
    return kwargs


def first_block_kwargs(model: torch.nn.Module, forward: Any, inputs: dict) -> dict:
    """The keyword arguments ``forward(**inputs)`` hands ``model``'s first block (a block's call
    traced alone by the compiled forms' tests)."""
    block = model.transformer_blocks[0]
    args: dict = {}
    original = type(block).forward

    def grab(self, *a: Any, **kw: Any) -> Any:
        if self is block:
            args.update(kw)
        return original(self, *a, **kw)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(block), "forward", grab)
        forward(**inputs)
    return args


def traced_first_block(model: torch.nn.Module, forward: Any, inputs: dict, forms: list) -> tuple[Any, Any, list]:
    """``model``'s first block under the compiled forms ``forms`` (each applied to nothing or the
    model, returning its undo): its output eagerly, traced by dynamo in one graph, and the call
    targets of that graph."""
    from tests.helpers.traced import traced

    block = model.transformer_blocks[0]
    args = first_block_kwargs(model, forward, inputs)
    undo = [form() for form in forms]
    try:
        with torch.no_grad():
            eager = block(**args)
            compiled, seen = traced(block, **args)
    finally:
        for u in reversed(undo):
            u()
    return eager, compiled, seen


def replays_with_forms(monkeypatch: pytest.MonkeyPatch, forms: Any, image: bool, cfg: bool) -> tuple[list, list, Any]:
    """Under emulated graphs with the K/V cache: the tiny pipeline under the compiled forms
    ``forms(pipe)`` (their undos) called eagerly for :data:`PROMPTS`, then accelerated, warmed up
    and called again. Returns (eager images, replayed images, the pipeline) with the calls after
    the warm-up checked to be replays: no miss, eager call or capture."""
    as_on_cuda(monkeypatch)
    given: dict[str, Any] = dict(use_kv_cache=True)
    if image:
        given.update(image=_condition_image(), output_resolution=SIDE)
    guidance = dict(true_cfg_scale=4.0, negative_prompt=" ") if cfg else {}
    seeds = _seeds(len(PROMPTS))
    pipe = _pipe()
    undo = forms(pipe)
    try:
        want = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
        accelerate_pipeline(pipe)
        pipe.accel.warmup([(SIDE, SIDE)], prompts=list(PROMPTS), cfg=cfg, call_kwargs=given, progress=False)
        before = _counts(pipe)
        got = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
    finally:
        for u in reversed(undo):
            u()
    assert _counts(pipe)["transformer"] == before["transformer"] and pipe.accel.stats()["transformer"].replays > 0
    return want, got, pipe


@pytest.mark.parametrize("processor", [QwenImage21AttnProcessor, QwenImage21FlexAttnProcessor])
@pytest.mark.parametrize("condition", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_the_forward_with_its_layout_factored_out_is_the_stock_forward(processor, condition, padded) -> None:
    pipe = _pipe()
    model = pipe.transformer
    model.set_attn_processor(processor())
    if processor is QwenImage21FlexAttnProcessor:
        pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(_seeds(1)[0])
    kwargs = _forward_inputs(g, condition=condition, padded=padded)
    memo = LayoutMemo()
    forward = layout_forward(model.forward, memo)
    assert forward is not None
    assert torch.equal(forward(**kwargs)[0], model(**kwargs)[0])
    # With the prefix K/V cache: the extract step fills each layer's cache as stock does, and the
    # cached steps read it, from either forward's cache.
    ours, stock = QwenImage21KVCache(len(model.transformer_blocks)), QwenImage21KVCache(len(model.transformer_blocks))
    a = forward(**kwargs, kv_cache=ours, kv_cache_mode="extract")[0]
    b = model(**kwargs, kv_cache=stock, kv_cache_mode="extract")[0]
    assert torch.equal(a, b)
    for x, y in zip(ours.layer_caches, stock.layer_caches):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
    kwargs["hidden_states"] = torch.randn(kwargs["hidden_states"].shape, generator=g)
    kwargs["timestep"] = torch.rand(kwargs["timestep"].shape, generator=g)
    assert torch.equal(forward(**kwargs, kv_cache=ours, kv_cache_mode="cached")[0],
                       model(**kwargs, kv_cache=stock, kv_cache_mode="cached")[0])  # fmt: skip
    # One layout per distinct masks, shared by the three modes' calls where they agree.
    assert memo.computed == len(memo) <= 3


def test_a_forward_that_is_not_diffusers_own_runs_stock(caplog) -> None:
    model = _pipe().transformer
    assert layout_forward(lambda **kw: model(**kw), LayoutMemo()) is None
    recipe = QwenImage21Recipe()

    def other(**kwargs):
        return model(**kwargs)

    assert recipe.wrap_forward(other) is other
    assert "not diffusers 0.42's QwenImage21Transformer2DModel.forward" in caplog.text


def test_a_mask_is_read_to_the_host_once_per_tensor_and_version() -> None:
    """Every step of a call hands the layout the same mask tensors: reading their values again would
    make the host wait for the GPU at every step. A write to a mask, or another tensor, reads it."""
    memo = LayoutMemo()
    mask = torch.tensor([[True, False, True]])
    first = memo.host_key(mask)
    assert memo.host_key(mask) == first and memo.host_reads == 1
    mask[0, 1] = True  # in place: its version moves on, so it is read again
    moved = memo.host_key(mask)
    assert moved != first and memo.host_reads == 2
    same_values = mask.clone()
    assert memo.host_key(same_values) == moved and memo.host_reads == 3
    assert memo.host_key(None) is None and memo.host_reads == 3
    with torch.inference_mode():
        kept_no_version = torch.tensor([[True, True]])
    assert memo.host_key(kept_no_version) == memo.host_key(kept_no_version) and memo.host_reads == 5
    # The tensor gone, another may take its id: the dead reference is never taken for it.
    ident = id(same_values)
    del same_values
    other = torch.tensor([[False, False, False]])
    if id(other) == ident:
        assert memo.host_key(other) != moved


# --------------------------------------------------------------------------------------------
# The pipeline, accelerated, against the stock pipeline
# --------------------------------------------------------------------------------------------
def _call(pipe, prompt: str, seed: int, steps: int = STEPS, **kwargs):
    out = pipe(prompt=prompt, height=SIDE, width=SIDE, num_inference_steps=steps, output_type="pt",
               generator=torch.Generator().manual_seed(seed), **kwargs)  # fmt: skip
    return out.images


def _counts(pipe) -> dict[str, tuple[int, int, int]]:
    return {name: (st.captures, st.misses, st.eager_calls) for name, st in pipe.accel.stats().items()}


CASES = [
    pytest.param(False, False, False, id="t2i"),
    pytest.param(False, True, False, id="t2i-cfg"),
    pytest.param(True, False, False, id="image"),
    pytest.param(True, True, False, id="image-cfg"),
    pytest.param(False, False, True, id="t2i-kv"),
    pytest.param(False, True, True, id="t2i-cfg-kv"),
    pytest.param(True, True, True, id="image-cfg-kv"),
]


@pytest.mark.parametrize(("image", "cfg", "kv"), CASES)
def test_after_warmup_three_calls_replay_every_step_bit_for_bit(emulated, image: bool, cfg: bool, kv: bool) -> None:
    pipe = _pipe()
    given = dict(use_kv_cache=kv)
    if image:
        given.update(image=_condition_image(), output_resolution=SIDE)
    guidance = dict(true_cfg_scale=4.0, negative_prompt=" ") if cfg else {}
    seeds = _seeds(len(PROMPTS))
    want = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]

    accelerate_pipeline(pipe)
    pipe.accel.warmup([(SIDE, SIDE)], prompts=list(PROMPTS), cfg=cfg, call_kwargs=given, progress=False)
    before = _counts(pipe)
    got = [_call(pipe, p, s, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
    after = _counts(pipe)
    st = pipe.accel.stats()["transformer"]
    assert st.replays > 0 and after["transformer"] == before["transformer"], (
        before,
        after,
    )  # no miss, eager call or capture
    # The text encoder was captured once per prompt (and the negative prompt) during the warm-up:
    # the hook the pipeline registers around every encode costs no capture.
    assert after["text_encoder"] == before["text_encoder"], (before, after)
    assert before["text_encoder"][0] == len(PROMPTS) + cfg
    assert pipe.accel.stats()["text_encoder"].replays >= len(PROMPTS) * (1 + cfg)


def test_a_replayed_call_reads_its_masks_once_not_at_every_step(emulated) -> None:
    pipe = _pipe()
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(SIDE, SIDE)], prompts=[PROMPTS[0]], progress=False)
    memo = pipe.accel.recipes["transformer"].layouts
    seed = _seeds(1)[0]
    for guidance in [{}, dict(true_cfg_scale=4.0, negative_prompt=" ")]:
        reads = []
        for steps in (2, 5):
            before, computed = memo.host_reads, memo.computed
            _call(pipe, PROMPTS[0], seed, steps=steps, **guidance)
            reads.append(memo.host_reads - before)
            assert memo.computed == computed  # every layout remembered from the warm-up
        # Each branch's image mask (and text mask, where it has one) once, whatever the steps.
        assert reads[0] == reads[1] and 1 + bool(guidance) <= reads[0] <= 2 * (1 + bool(guidance)), reads


def _documented(pipe) -> tuple[list[torch.Tensor], tuple[int, int, int], tuple[int, int, int]]:
    """Stock images of the warm-up's own prompt (accel's DEFAULT_WARMUP_PROMPT) with guidance off
    and on, then ``warmup([(w, h)])`` as the README writes it and the same calls accelerated:
    (stock, accelerated) images and the denoiser's counts before and after those calls."""
    seed, prompt = _seeds(1)[0], "a photograph"
    calls = [dict(), dict(true_cfg_scale=4.0, negative_prompt=" ")]
    want = [_call(pipe, prompt, seed, **c) for c in calls]
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup([(SIDE, SIDE)], progress=False)
    assert report.total_captures > 0 and not report.skipped
    before = _counts(pipe)["transformer"]
    got = [_call(pipe, prompt, seed, **c) for c in calls]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    return got, before, _counts(pipe)["transformer"]


def test_the_documented_warmup_raises_nothing_and_its_calls_are_the_stock_ones(emulated) -> None:
    _documented(_pipe())


def test_the_documented_warmup_captures_what_its_calls_replay(emulated) -> None:
    # The pipeline's default call keeps the prefix K/V cache (use_kv_cache=True).
    _, before, after = _documented(_pipe())
    assert after == before


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "masks-read-in-the-break"])
def test_same_shapes_another_layout_is_a_graph_of_its_own(monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    """A call whose masks lay the tokens out otherwise, at the same shapes, replays graphs of its
    own, not the first layout's. Routed (as on a GPU), the masks' token is part of the call's
    signature: an entry of its own. Without the routing the layout break reads the masks, and its
    host values (prefix length, segments), part of its output's structure, pick a chain of its own
    within the one entry."""
    if routed:
        as_on_cuda(monkeypatch)
    else:
        emulate_pipelines(monkeypatch)
    pipe = _pipe()
    model = pipe.transformer
    g = torch.Generator().manual_seed(_seeds(1)[0])
    first = _forward_inputs(g, condition=True, padded=True)
    moved = torch.zeros_like(first["img_mask"])
    moved[:, 6:8] = True  # the condition image's slots after more of the text
    moved[:, -4:] = True
    second = {**first, "img_mask": moved}
    with torch.no_grad():
        want = [model(**first)[0], model(**second)[0]]
    accelerate_pipeline(pipe, capture_on_miss=True)
    with torch.no_grad():
        got = [model(**first)[0].clone(), model(**second)[0].clone(), model(**first)[0].clone()]
    for a, b in zip(got, [*want, want[0]]):
        assert torch.equal(a, b)
    st = pipe.accel.stats()["transformer"]
    # The second layout captured its own on its first call; the third call (the first layout
    # again) replayed the first's. (A capture replays what it captured: 2 replays with them.)
    assert (st.captures, st.replays, st.eager_calls) == (2, 3, 0), st
    if routed:
        assert st.entries == 2 and st.path_switches == 0, st
    else:
        assert st.entries == 1 and len(st.paths_per_entry[0]) == 2, st
        assert (st.path_captures, st.path_switches) == (1, 1), st


@pytest.mark.parametrize("kv", [False, True])
def test_taylorseer_under_graphs_equals_it_run_eagerly(emulated, kv: bool) -> None:
    """diffusers' TaylorSeer, the one step cache of diffusers 0.42 that takes this transformer
    (FirstBlockCache and MagCache need its block registered, cache-dit lists Qwen-Image's only):
    its decisions as breaks, both paths captured, every call equal to the same cache run eagerly."""
    from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache

    pipe = _pipe()
    apply_taylorseer_cache(pipe.transformer, TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2))
    cases = [(s, "a fox in the snow") for s in _seeds(3)]  # one signature: only the first call captures
    kwargs = dict(true_cfg_scale=4.0, negative_prompt="blurry", use_kv_cache=kv)
    accelerate_pipeline(pipe, mode="eager")
    want = [_call(pipe, p, s, CACHED_STEPS, **kwargs) for s, p in cases]
    pipe.accel.restore()
    accelerate_pipeline(pipe, capture_on_miss=True)
    got = [_call(pipe, *cases[0][::-1], CACHED_STEPS, **kwargs)]
    captured = pipe.accel.stats()["transformer"].captures
    got += [_call(pipe, p, s, CACHED_STEPS, **kwargs) for s, p in cases[1:]]
    assert pipe.accel.stats()["transformer"].captures == captured
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: max diff {(a - b).abs().max()}"
    hook = pipe.accel.hooks["transformer"]
    assert hook.active and hook.caches.active, hook.inactive_reason
    st = pipe.accel.stats()["transformer"]
    assert st.replays > 0 and st.eager_calls == 0 and st.path_captures > 0, st


def test_a_batch_of_prompts_of_two_lengths_and_several_images_per_prompt_replay_bit_for_bit(emulated) -> None:
    """Two prompts of different lengths: the pipeline pads the shorter one and masks it, so the
    layout carries a key-valid mask; one prompt, two images: the latents are batched, the masks
    not. Captured on first use, then replayed."""
    pipe = _pipe()
    batches = [
        dict(prompt=["a fox", "a lighthouse on a cliff at night"]),
        dict(prompt=["a cat"], num_images_per_prompt=2),
    ]

    def call(seed: int, kwargs: dict) -> torch.Tensor:
        n = len(kwargs["prompt"]) * kwargs.get("num_images_per_prompt", 1)
        generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
        return pipe(height=SIDE, width=SIDE, num_inference_steps=STEPS, output_type="pt", use_kv_cache=False,
                    generator=generators, **kwargs).images  # fmt: skip

    seeds = _seeds(len(batches))
    want = [call(s, b) for s, b in zip(seeds, batches)]
    accelerate_pipeline(pipe, capture_on_miss=True)
    for _ in range(2):
        got = [call(s, b) for s, b in zip(seeds, batches)]
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    st = pipe.accel.stats()["transformer"]
    assert st.eager_calls == 0 and st.misses == 0 and st.captures == 2 and st.replays >= 6, st
    assert any("2x" in path for paths in st.paths_per_entry for path in paths)  # a batch's key-valid mask


def test_float8_keeps_the_recipes_layers_and_its_graphs_replay_the_quantized_model(emulated) -> None:
    """quantize="fp8" as on Qwen-Image (tests/hooks/fp8/test_quantize.py), against the stand-in
    quantizer: the layers the recipe names stay bf16, the rest are measured and quantized within
    the budget at the first warm-up, and the graphs replay the quantized model bit for bit with it
    run eagerly."""
    from tests.helpers.fake_quant import GridLinear, use_grid

    use_grid(emulated, levels=64)
    pipe = _pipe()
    accelerate_pipeline(pipe, quantize="fp8", fp8_budget=0.05)
    given = dict(use_kv_cache=False)
    pipe.accel.warmup([(SIDE, SIDE)], prompts=[PROMPTS[0]], cfg=False, call_kwargs=given, progress=False)
    sel = pipe.accel.quantization.selection
    kept = {"img_in", "txt_in.in_layer", "txt_in.out_layer", "modulation.1", "norm_out.linear", "proj_out",
            "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"}  # fmt: skip
    assert set(sel.kept_by_recipe) == kept and sel.quantized and sel.error <= sel.budget
    assert all(n.startswith("transformer_blocks.") for n in sel.quantized)
    layers = dict(pipe.transformer.named_modules())
    assert all(type(layers[n]) is GridLinear for n in sel.quantized)
    seeds = _seeds(2)
    before = _counts(pipe)["transformer"]
    got = [_call(pipe, PROMPTS[0], s, **given) for s in seeds]
    assert _counts(pipe)["transformer"] == before  # replayed: no miss, no capture
    pipe.accel.restore()  # the float8 layers stay: the eager reference runs the same model
    for seed, out in zip(seeds, got):
        assert torch.equal(out, _call(pipe, PROMPTS[0], seed, **given))
