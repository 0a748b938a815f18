"""Qwen-Image's VAE decoder in graphs, on emulated CUDA graphs: the whole path, pipeline to replay.

diffusers' ``AutoencoderKLQwenImage._decode`` calls its causal decoder with ``feat_cache=[None] * n``
and ``feat_idx=[0]``, which the decoder fills (accel.graphs.stores records what it stores and every
replay puts it back). A tiny pipeline warmed up at two resolutions decodes every later call from
its graphs, none eagerly, and its images equal the stock pipeline's bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.generate import generate

PROMPT = "a red fox in the snow"
SIZES = [(64, 48), (48, 32)]  # (width, height)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_pipelines(monkeypatch)


@torch.no_grad()
def test_qwen_image_decoder_replays_its_feature_cache_and_equals_the_stock_pipeline(emulated: None) -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    want = {wh: generate(pipe, PROMPT, size=wh, output_type="pt") for wh in SIZES}

    accelerate_pipeline(pipe, text_buckets=None)
    pipe.accel.warmup(SIZES, cfg=False, prompts=[PROMPT], progress=False)
    decoder = pipe.accel.runners["vae.decoder"]
    before = decoder.stats()
    assert before.entries == len(SIZES) and not decoder.blocked, (decoder.blocked, pipe.accel.report())
    assert before.stored_bytes > 0

    calls = SIZES * 2
    random.Random(0).shuffle(calls)
    for wh in calls:
        got = generate(pipe, PROMPT, size=wh, output_type="pt")
        assert torch.equal(got, want[wh]), wh
    after = decoder.stats()
    assert after.eager_calls == before.eager_calls and after.misses == before.misses
    assert after.replays - before.replays == len(calls) and after.captures == before.captures
    # What the decoder stores is dropped by the VAE's clear_cache after each decode: the caller's
    # list held the replay's copies, not the graphs' memory.
    assert pipe.vae._feat_map == [None] * pipe.vae._conv_num
    pipe.accel.restore()
