"""Graphs beyond the denoiser (full-size random-weight pipelines, bf16): text encoders and the VAE
decoder (Qwen-Image's causal one with the feature cache it fills) replay bit-identical to eager,
and capture failures are found and broken automatically.

* Decoded images and text embeddings of the accelerated pipeline (text buckets off, so nothing is
  padded) equal the stock pipeline's bit for bit, for several resolutions and prompts sharing one
  pool, called in shuffled order with allocator churn in between.
* Diffusers transformers without a recipe (Lumina2 and Qwen-Image's with a text mask, small) fail
  to capture on host syncs; with ``auto_breaks`` the runner names each breaking function and line,
  runs it as an eager break, and keeps a graph equal to eager.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from accel import accelerate_pipeline
from accel.graphs import tree
from accel.graphs.runner import GraphRunner
from accel.hooks.images import decoder_trial
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda

RESOLUTIONS = [(768, 512), (512, 512), (1024, 1024)]  # (width, height), warmed in any order
PROMPTS = [
    "a red fox in fresh snow at dawn",
    "an isometric cutaway of a tiny underground library lit by lanterns, with a sleeping cat on a pile of books",
]
NEGATIVE = "blurry, low quality"
STEPS = 2


def _image(pipe, name: str, prompt: str, wh: tuple[int, int]) -> torch.Tensor:
    return generate(
        pipe, prompt, size=wh, steps=STEPS, negative_prompt=NEGATIVE, guidance=4.0, device="cuda", output_type="pt"
    )


def _embeddings(pipe, name: str, prompt: str) -> list[torch.Tensor]:
    if name == "qwen-image":
        out = pipe.encode_prompt(prompt=prompt, device=pipe._execution_device)
    else:
        out = pipe.encode_prompt(prompt=prompt, device=pipe._execution_device, do_classifier_free_guidance=False)
    return [t.clone() for t in tree.tensors(out)]


def _churn() -> None:
    # Allocations of odd sizes between calls, so a graph that read freed memory would show it.
    junk = [torch.randn(n, device="cuda") for n in (1 << 20, 3 << 18, 5 << 16)]
    del junk
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=["z-image", "qwen-image"])
def model(request):
    pipe = build_pipeline(request.param, size="full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    yield request.param, pipe
    if "accel" in pipe.__dict__:
        pipe.accel.restore()
    del pipe
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def test_decoded_images_and_embeddings_equal_eager(model, monkeypatch) -> None:
    name, pipe = model
    cases = [(p, wh) for p in PROMPTS for wh in RESOLUTIONS]
    images = {c: _image(pipe, name, *c) for c in cases}
    embeds = {p: _embeddings(pipe, name, p) for p in PROMPTS}

    # Every size's decoder graph kept, untimed: their replays are what this test holds to eager
    # (test_the_decoder_keeps_graphs_only_where_they_pay times them).
    monkeypatch.setattr(decoder_trial, "timed_on", lambda device: False)
    accelerate_pipeline(pipe, text_buckets=None)
    report = pipe.accel.warmup(RESOLUTIONS, prompts=PROMPTS, negative_prompt=NEGATIVE, cfg=True, progress=False)
    print(f"\n{name} warmup:\n{report}\n{pipe.accel.report()}")
    stats = pipe.accel.stats()
    # Both decoders replay at every resolution. Qwen-Image's causal video decoder fills the feature
    # cache it is given (feat_cache, feat_idx), which every replay puts back (accel.graphs.stores).
    assert stats["vae.decoder"].entries == len(RESOLUTIONS), pipe.accel.report()
    assert not pipe.accel.runners["vae.decoder"].blocked, pipe.accel.report()
    if name == "qwen-image":
        print(f"qwen-image decoder: {stats['vae.decoder'].stored_bytes / 2**20:.1f} MiB copied out per replay of each")
    assert stats["text_encoder"].entries >= 1, pipe.accel.report()
    before = {k: s.replays for k, s in pipe.accel.stats().items()}
    eager_before = pipe.accel.stats()["vae.decoder"].eager_calls

    random.Random(0).shuffle(cases)
    for case in cases + cases[:2]:
        _churn()
        out = _image(pipe, name, *case)
        assert torch.equal(out, images[case]), f"{name} {case}: decoded image differs from eager"
    for p in PROMPTS:
        got = _embeddings(pipe, name, p)
        assert len(got) == len(embeds[p]) and all(torch.equal(a, b) for a, b in zip(got, embeds[p])), p
    after = pipe.accel.stats()
    assert after["vae.decoder"].replays - before["vae.decoder"] == len(cases) + 2
    assert after["vae.decoder"].eager_calls == eager_before, pipe.accel.report()
    assert after["text_encoder"].replays > before["text_encoder"], pipe.accel.report()
    assert after["text_encoder"].misses == 0 and after["vae.decoder"].misses == 0, pipe.accel.report()
    pipe.accel.restore()


@torch.no_grad()
def test_the_decoder_keeps_graphs_only_where_they_pay(model) -> None:
    """The warm-up measures each size's decoder replay against its eager decode (time and memory):
    graphs are kept where they pay (accel/hooks/images/decoder_verdict.py), the rest decode
    eagerly; every image equals eager's either way."""
    name, pipe = model
    prompt = PROMPTS[0]
    images = {wh: _image(pipe, name, prompt, wh) for wh in RESOLUTIONS}
    accelerate_pipeline(pipe, text_buckets=None)
    report = pipe.accel.warmup(RESOLUTIONS, prompts=[prompt], negative_prompt=NEGATIVE, cfg=True, progress=False)
    print(f"\n{name} warmup:\n{report}")
    timings = [r.decoder for r in report.rows]
    assert all(t is not None and t.graph_ms > 0 and t.eager_ms > 0 for t in timings), report
    # Measured on the device: what each trial graph held in its pool, and each eager decode's transient.
    assert all(t.graph_bytes > 0 and t.eager_bytes > 0 and t.kept is not None for t in timings), timings
    print("\n".join(f"  {t.label}: {t.verdict}, {t.times()}; {t.memory()}" for t in timings))
    kept = sum(t.kept for t in timings)
    decoder = pipe.accel.runners["vae.decoder"]
    assert decoder.stats().entries == kept and len(decoder.blocked) == len(RESOLUTIONS) - kept
    assert all(r.startswith(decoder_trial.NOT_KEPT) for r in decoder.blocked.values())
    assert decoder.pool is pipe.accel.runners["transformer"].pool
    before = decoder.stats()
    for wh in RESOLUTIONS:
        _churn()
        assert torch.equal(_image(pipe, name, prompt, wh), images[wh]), wh
    after = decoder.stats()
    assert after.replays - before.replays == kept and after.eager_calls - before.eager_calls == len(RESOLUTIONS) - kept
    pipe.accel.restore()


@torch.no_grad()
def test_a_transformer_without_recipe_is_captured_through_found_breaks() -> None:
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    model = Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=16,
        cap_feat_dim=32,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(64, 32, 32),
    ).to("cuda", torch.bfloat16)
    model.eval()
    x = torch.randn(1, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    t = torch.rand(1, device="cuda")
    caption = torch.randn(1, 12, 32, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 12, dtype=torch.bool, device="cuda")
    mask[:, 9:] = False
    kwargs = dict(hidden_states=x, timestep=t, encoder_hidden_states=caption, encoder_attention_mask=mask)
    want = model(**kwargs, return_dict=False)[0]
    runner = GraphRunner(model.forward, name="lumina2", auto_breaks=True)
    try:
        assert runner.capture(**kwargs, return_dict=False), runner.blocked
        print("\nlumina2 breaks found: " + "; ".join(map(str, runner.found_breaks)))
        assert any("tolist" in s.line or "item" in s.line for s in runner.found_breaks), runner.found_breaks
        got = runner(**kwargs, return_dict=False)[0]
        assert torch.equal(got, want)
        # Other inputs of the same signature replay too (the break recomputes what it must).
        x2 = torch.randn_like(x)
        assert torch.equal(
            runner(**{**kwargs, "hidden_states": x2}, return_dict=False)[0],
            model(**{**kwargs, "hidden_states": x2}, return_dict=False)[0],
        )
    finally:
        runner.release()
        runner.unmark()
