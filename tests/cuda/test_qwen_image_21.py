"""Qwen-Image 2.1 at full size (a 7B transformer, Qwen3-VL-8B, random weights, bf16) on real CUDA graphs.

The recipe's graphs against the stock pipeline run eagerly, bit for bit: text-to-image and with a
condition image, true CFG on and off, the prefix K/V cache on and off, at 1024x1024 and 512x512,
three prompts and seeds each, the graphs' outputs NaN-poisoned before every call; after the
warm-up no miss, no eager denoiser call, no capture (the text encoder's either). With
``compile=True``: graphs against the same compiled model without graphs. With
``quantize="fp8"``: graphs against the same quantized model without graphs, eager and compiled.
Timings are scripts/bench_fp8.py's (``--only qwen-image-2.1``), never a test's.
"""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch
from PIL import Image

from accel import accelerate_pipeline
from accel.graphs.tree import tensors
from accel.hooks.fp8 import quantizers
from accel.hooks.images.decoder_trial import NOT_KEPT
from pipelines.builders import build_pipeline

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
STEPS = 4
PROMPTS = (
    "a red fox in fresh snow at dawn",
    "a cat",
    "an isometric cutaway of a tiny underground library lit by lanterns",
)
NEGATIVE = "blurry, low quality"


@pytest.fixture(scope="module")
def pipe():
    pipe = build_pipeline("qwen-image-2.1", "full", device=DEVICE, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    del pipe
    gc.collect()
    torch.cuda.empty_cache()


def _condition(side: int) -> Image.Image:
    pixels = np.random.default_rng(7).integers(0, 256, size=(side * 3 // 4, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _call(pipe, prompt: str, seed: int, side: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, decoded pixels in [0, 1]) of one call."""
    latents = []

    def keep(p, i, t, kw):
        if i == STEPS - 1:
            latents.append(kw["latents"].clone())
        return {}

    out = pipe(prompt=prompt, height=side, width=side, num_inference_steps=STEPS, output_type="pt",
               generator=torch.Generator(DEVICE).manual_seed(seed), callback_on_step_end=keep, **kwargs)  # fmt: skip
    return latents[0], out.images


def _poison(pipe) -> None:
    """Every graph output and boundary buffer of the denoiser NaN: a replay that skipped writing
    one shows."""
    for entry in pipe.accel.runners["transformer"].store.entries.values():
        for chain in entry.tree.chains.values():
            for t in [*tensors(chain.output), *(t for b in chain.graph.breaks for t in tensors(b.buffer))]:
                if t.is_floating_point():
                    t.fill_(float("nan"))


def _counts(pipe) -> dict[str, tuple[int, int, int]]:
    return {name: (st.captures, st.misses, st.eager_calls) for name, st in pipe.accel.stats().items()}


SETTINGS = [
    pytest.param(1024, False, False, False, id="1024-t2i"),
    pytest.param(1024, False, True, False, id="1024-t2i-cfg"),
    pytest.param(512, True, True, False, id="512-image-cfg"),
    pytest.param(1024, False, False, True, id="1024-t2i-kv"),
    pytest.param(1024, False, True, True, id="1024-t2i-cfg-kv"),
    pytest.param(512, True, True, True, id="512-image-cfg-kv"),
]


@pytest.mark.parametrize(("side", "image", "cfg", "kv"), SETTINGS)
@torch.no_grad()
def test_graphs_equal_the_stock_pipeline_bit_for_bit(pipe, side: int, image: bool, cfg: bool, kv: bool) -> None:
    given = dict(use_kv_cache=kv)
    if image:
        given.update(image=_condition(side), output_resolution=side)
    guidance = dict(true_cfg_scale=4.0, negative_prompt=NEGATIVE) if cfg else {}
    seeds = [0, 1, 2]
    want = [_call(pipe, p, s, side, **given, **guidance) for p, s in zip(PROMPTS, seeds)]
    accelerate_pipeline(pipe)
    try:
        report = pipe.accel.warmup(
            [(side, side)], prompts=list(PROMPTS), negative_prompt=NEGATIVE, cfg=cfg, call_kwargs=given, progress=False
        )
        print(f"\n{side} image={image} cfg={cfg} kv={kv}:\n{report}")
        before = _counts(pipe)
        order = list(range(len(PROMPTS)))
        random.Random(side).shuffle(order)
        for i in order:
            _poison(pipe)
            latents, pixels = _call(pipe, PROMPTS[i], seeds[i], side, **given, **guidance)
            assert torch.equal(latents, want[i][0]), f"{PROMPTS[i]!r}: {(latents - want[i][0]).abs().max()}"
            assert torch.equal(pixels, want[i][1])
        after = _counts(pipe)
        # The decoder decodes eagerly at a size where its warm-up trial kept no graphs (they did not
        # pay there: accel/hooks/images/decoder_verdict.py), one eager call per pipeline call; every
        # other runner, text encoder included: no miss, no eager call, no capture.
        decoder = next(r.decoder for r in report.rows if (r.width, r.height) == (side, side))
        eager_decodes = 0 if decoder is None or decoder.kept else len(order)
        if eager_decodes:
            reason = pipe.accel.runners["vae.decoder"].blocked.get(decoder.key, "")
            assert reason.startswith(NOT_KEPT) and decoder.why in reason, reason
        captures, misses, eager = before["vae.decoder"]
        before["vae.decoder"] = (captures, misses, eager + eager_decodes)
        assert after == before, (before, after)
        assert pipe.accel.stats()["transformer"].replays > 0
        print(pipe.accel.report())
    finally:
        pipe.accel.restore()


def _without_graphs(pipe, *args, **kwargs):
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        return _call(pipe, *args, **kwargs)
    finally:
        runner.enabled = True


def _compiled_session(pipe, cache_dir, *, quantize: bool) -> tuple[list[str], object]:
    """compile=True (and quantize="fp8" where asked): warm up two sizes, with and without true
    CFG, the K/V cache on and off; shuffled calls against the same compiled model without graphs.
    The mismatches, and the float8 layer selection (None without quantize)."""
    torch._dynamo.reset()
    options = dict(quantize="fp8") if quantize else {}
    accelerate_pipeline(pipe, compile=True, compile_cache_dir=cache_dir, **options)
    try:
        return _compiled_calls(pipe, quantize)
    finally:
        pipe.accel.restore()


def _compiled_calls(pipe, quantize: bool) -> tuple[list[str], object]:
    # The second warm-up compiles the K/V cache's other form: it captures the first one's cases
    # again (their graphs were dropped by that compile), so no call after it captures.
    sizes = [(1024, 1024), (512, 512)]
    for kv in (True, False):
        report = pipe.accel.warmup(sizes, prompts=list(PROMPTS[:2]), negative_prompt=NEGATIVE,
                                   call_kwargs=dict(use_kv_cache=kv), progress=False)  # fmt: skip
        print(f"\ncompile=True{' quantize=fp8' if quantize else ''} kv={kv} warm-up:\n{report}")
        assert report.total_captures > 0
    st0 = pipe.accel.stats()["transformer"]
    cases = [
        (p, s, side, cfg, kv)
        for p in PROMPTS[:2]
        for s in (0, 1)
        for side in (1024, 512)
        for cfg in (False, True)
        for kv in (True, False)
    ]
    random.Random(0).shuffle(cases)
    mismatches = []
    for prompt, seed, side, cfg, kv in cases[:8]:
        kwargs = dict(use_kv_cache=kv, **(dict(true_cfg_scale=4.0, negative_prompt=NEGATIVE) if cfg else {}))
        want, _ = _without_graphs(pipe, prompt, seed, side, **kwargs)
        _poison(pipe)
        got, _ = _call(pipe, prompt, seed, side, **kwargs)
        if not torch.equal(got, want):
            mismatches.append(f"{prompt[:12]!r} {side} cfg={cfg} kv={kv}: max diff {(got - want).abs().max():.4g}")
    st = pipe.accel.stats()["transformer"]
    print(pipe.accel.report())
    assert not mismatches, mismatches
    assert (st.captures, st.misses, st.eager_calls) == (st0.captures, st0.misses, st0.eager_calls), (st0, st)
    return mismatches, pipe.accel.quantization.selection if quantize else None


@torch.no_grad()
def test_compiled_graphs_equal_the_same_compiled_model_without_graphs(pipe, tmp_path) -> None:
    mismatches, _ = _compiled_session(pipe, tmp_path, quantize=False)
    assert not mismatches, mismatches


@pytest.mark.parametrize("layers", ["recipe", "torchao", "recipe-modulation-in-block"])
@torch.no_grad()
def test_float8_compiled_graphs_equal_the_same_model_without_graphs(pipe, tmp_path, monkeypatch, layers: str) -> None:
    """With the recipe's float8 layers (the library's: their down projections take the SwiGLU into
    their quantization, their norms write their input), with torchao's, and with the recipe's and
    its modulation_in_block form (off by default until measured)."""
    if torch.cuda.get_device_capability() < quantizers.MIN_FP8_CAPABILITY:
        pytest.skip("float8 products need compute capability 8.9 or newer")
    pytest.importorskip("torchao")
    from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe

    if layers == "torchao":
        monkeypatch.setattr(QwenImage21Recipe, "fp8_layers", None)
    if layers == "recipe-modulation-in-block":
        monkeypatch.setattr(QwenImage21Recipe, "modulation_in_block", True)
    # Quantizing is one-way: a pipeline of its own, the module's waiting on the host meanwhile
    # (two full-size pipelines and a compiled one's graphs do not fit 80 GB).
    shared, pipe = pipe, None
    shared.to("cpu")
    torch.cuda.empty_cache()
    pipe = build_pipeline("qwen-image-2.1", "full", device=DEVICE, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    try:
        bf16, _ = _call(pipe, PROMPTS[0], 0, 1024)
        mismatches, sel = _compiled_session(pipe, tmp_path, quantize=True)
        assert sel is not None and sel.quantized and sel.error <= sel.budget
        got, _ = _call(pipe, PROMPTS[0], 0, 1024)
        print(
            f"float8 latents vs bf16: rel L2 {((got.float() - bf16.float()).norm() / bf16.float().norm()).item():.4f}"
        )
        assert not mismatches, mismatches
    finally:
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        shared.to(DEVICE)
