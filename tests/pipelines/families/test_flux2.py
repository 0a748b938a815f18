"""FLUX.2 [klein] and klein KV, the family in pipelines/families/flux2/: released sizes (on the meta
device), and the tiny pipelines under emulated CUDA graphs (tests/helpers/emulator.py) with the
library's defaults: the documented warm-up, then calls with other prompts and seeds replay every
denoiser step, bit-equal to the stock pipeline. The KV pipeline's first step extracts the reference
image's K/V into a cache it returns, every later step reads it back: request-scoped state
(accel/graphs/stores.py), matched by its structure."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline

from accel import accelerate_pipeline, warmup_image
from pipelines.builders import build_pipeline, build_text_encoder, build_transformer
from pipelines.construction import constructing_on
from tests.helpers.emulator import emulate_pipelines

pytestmark = pytest.mark.usefixtures("few_threads")

SIZE = 64  # pixels a side: 4x4 latent tokens after 2x2 packing
CALLS = [("a red fox in the snow", 1), ("a lighthouse at dusk, oil painting", 7), ("tea", 123)]
STEPS = 4  # as the models are run (their family's generation defaults)


@pytest.mark.parametrize(
    ("name", "transformer", "text_encoder"),
    [("flux2-klein", 3.876e9, 4.022e9), ("flux2-klein-kv", 9.079e9, 8.191e9)],
)
def test_full_sizes_are_the_releases(name: str, transformer: float, text_encoder: float) -> None:
    with constructing_on("meta", torch.bfloat16):
        counts = [
            sum(p.numel() for p in build(name, "full", device="meta").parameters())
            for build in (build_transformer, build_text_encoder)
        ]
    assert counts[0] == pytest.approx(transformer, rel=1e-3) and counts[1] == pytest.approx(text_encoder, rel=1e-3)


def _call(pipe: Any, prompt: str, seed: int, image: Any, output_type: str) -> Any:
    extra: dict[str, Any] = {"image": image} if image is not None else {}
    if isinstance(pipe, Flux2KleinPipeline):
        extra["guidance_scale"] = 1.0  # distilled: its guidance scale changes nothing (above 1 it warns so)
    generator = torch.Generator().manual_seed(seed)
    out = pipe(prompt=prompt, height=SIZE, width=SIZE, num_inference_steps=STEPS, generator=generator,
               output_type=output_type, **extra)  # fmt: skip
    return out.images


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("name", "reference", "output_type"),
    [("flux2-klein", False, "np"), ("flux2-klein-kv", True, "np"), ("flux2-klein-kv", False, "latent")],
    ids=["klein", "klein-kv-reference", "klein-kv-text-only"],
)
def test_after_the_documented_warmup_every_step_replays_bit_equal(
    name: str, reference: bool, output_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    emulate_pipelines(monkeypatch)
    pipe = build_pipeline(name, "tiny")
    assert isinstance(pipe, Flux2KleinKVPipeline if name.endswith("kv") else Flux2KleinPipeline)
    image = warmup_image(SIZE, SIZE, seed=11) if reference else None
    want = [_call(pipe, p, s, image, output_type) for p, s in CALLS]
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(SIZE, SIZE)], progress=False)
    before = pipe.accel.stats()["transformer"]
    got = [_call(pipe, p, s, image, output_type) for p, s in CALLS]
    assert all(_equal(a, b) for a, b in zip(got, want, strict=True)), pipe.accel.report()
    st = pipe.accel.stats()["transformer"]
    assert st.misses == 0 and st.eager_calls == 0, pipe.accel.report()
    assert st.replays - before.replays == len(CALLS) * STEPS and st.captures == before.captures
    if reference:
        # Step 0 (the reference's tokens, the cache made) and steps 1.. (the cache read) are two
        # graphs; each call's cache is copied into the later steps' graph once, then found in place.
        assert st.state_bytes_kept > before.state_bytes_kept
