"""FLUX.2 [klein] KV on real CUDA graphs: the full-size 9B KV pipeline (bf16, random weights) at a
small size, with a reference image, after the documented warm-up: every denoiser step replays and
the images equal the stock pipeline's bit for bit; the plain klein 4B pipeline too. The first
step's graph makes the reference's K/V cache and returns it; the later steps' graph reads it
(request-scoped state, accel/graphs/stores.py)."""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline, warmup_image
from pipelines.builders import build_pipeline

pytestmark = pytest.mark.cuda

SIZE = 256
CALLS = [("a red fox in the snow", 1), ("a lighthouse at dusk, oil painting", 7)]


@pytest.mark.parametrize(("name", "reference"), [("flux2-klein-kv", True), ("flux2-klein", False)])
@torch.no_grad()
def test_full_size_replays_every_step_bit_equal(name: str, reference: bool) -> None:
    pipe = build_pipeline(name, "full", device="cuda", dtype=torch.bfloat16)
    image = warmup_image(SIZE, SIZE, seed=3) if reference else None
    extra = {"image": image} if reference else {"guidance_scale": 1.0}

    def run() -> list[torch.Tensor]:
        return [
            pipe(
                prompt=p,
                num_inference_steps=4,
                height=SIZE,
                width=SIZE,
                generator=torch.Generator("cuda").manual_seed(s),
                output_type="pt",
                **extra,
            ).images
            for p, s in CALLS
        ]

    want = run()
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(SIZE, SIZE)], progress=False)
    before = pipe.accel.stats()["transformer"]
    got = run()
    report = pipe.accel.report()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), report
    st = pipe.accel.stats()["transformer"]
    assert st.misses == 0 and st.eager_calls == 0 and st.replays - before.replays == len(CALLS) * 4, report
    if reference:
        assert st.state_bytes_kept > before.state_bytes_kept, report
    pipe.accel.restore()
