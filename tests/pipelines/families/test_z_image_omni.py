"""Z-Image Omni (``ZImageOmniPipeline``) under graphs, on tiny pipelines and emulated CUDA graphs that
refuse pageable copies as a GPU does (tests/helpers/after_warmup.py).

The documented warm-up (``pipe.accel.warmup([(w, h)])``, and with ``call_kwargs=dict(image=...)``
for condition images) raises nothing; after it, calls with other prompts and seeds, at two sizes
in shuffled order, replay every denoiser step, never run it eagerly, and equal the stock pipeline
bit for bit; the text encoder keeps the graphs its warm-up captured. The recipe's pieces are
tested on the transformer itself: padded captions give the stock forward's output bit for bit,
lengths in one multiple of 32 share a signature, the warm-up's caption segments are the
pipeline's own, and without the recipe's breaks the capture fails on the model's pageable copies.
"""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from accel import accelerate_pipeline
from accel.graphs.signature import flatten
from pipelines.builders import build_pipeline
from pipelines.families.z_image import omni
from pipelines.families.z_image.recipe import ZImageRecipe
from tests.helpers.after_warmup import as_on_cuda, assert_replayed_only, counts

pytestmark = pytest.mark.usefixtures("few_threads")

PROMPTS = ["a red fox in the snow", "a lighthouse on a cliff at night, waves breaking on the rocks below it", "tea"]
SIZES = [(64, 64), (96, 64)]


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    as_on_cuda(monkeypatch)


def _pipe(dtype: torch.dtype = torch.float32):
    pipe = build_pipeline("z-image-omni", "tiny", dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(width: int, height: int, seed: int) -> Image.Image:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def _call(pipe, prompt: str, seed: int, size: tuple[int, int], guidance: float, **extra) -> torch.Tensor:
    return pipe(
        prompt=prompt,
        width=size[0],
        height=size[1],
        num_inference_steps=3,
        guidance_scale=guidance,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
        **extra,
    ).images


def _runs() -> list[tuple[str, int, tuple[int, int]]]:
    runs = [(p, 10 + i, size) for i, p in enumerate(PROMPTS) for size in SIZES]
    random.Random(0).shuffle(runs)
    return runs


@pytest.mark.parametrize("guidance", [5.0, 0.0], ids=["cfg", "no-cfg"])
def test_documented_warmup_then_every_step_replays_bit_for_bit(graphs, guidance: float) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe)
    pipe.accel.warmup(SIZES, cfg=guidance > 0, progress=False)
    before = counts(pipe)
    for prompt, seed, size in _runs():
        got = _call(pipe, prompt, seed, size, guidance)
        assert torch.equal(got, _call(stock, prompt, seed, size, guidance)), (prompt, size)
    assert_replayed_only(before, counts(pipe), pipe.accel.report())
    assert "the stock pipeline's, bit for bit" in pipe.accel.report()
    # The token layout's output, compared at every replay, is a few dozen values: its per-token
    # noise masks (thousands of ints at full size) count as one each.
    paths = [p for entry in pipe.accel.stats()["transformer"].paths_per_entry for p in entry]
    assert paths and all(p.count(",") < 100 for p in paths), paths


def test_condition_images_warm_up_from_call_kwargs_and_replay_bit_for_bit(graphs) -> None:
    # bf16: the pipeline encodes condition images with `image.bfloat16()` whatever the VAE's dtype.
    pipe, stock = _pipe(torch.bfloat16), _pipe(torch.bfloat16)
    image = _image(96, 64, seed=3)
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(64, 64)], prompts=PROMPTS, call_kwargs=dict(image=image), progress=False)
    before = counts(pipe)
    for i, prompt in enumerate(PROMPTS):
        got = _call(pipe, prompt, i, (64, 64), 5.0, image=image)
        assert torch.equal(got, _call(stock, prompt, i, (64, 64), 5.0, image=image)), prompt
    assert_replayed_only(before, counts(pipe), pipe.accel.report())


def test_without_the_recipes_breaks_the_pageable_copies_break_the_capture(graphs, monkeypatch) -> None:
    """The emulator refuses the omni mode's ``torch.tensor(list, device=...)`` as a GPU does: with
    the recipe's omni handling gone (and found breaks off) the capture fails; with it, it does not."""
    want = _call(_pipe(), PROMPTS[0], 0, SIZES[0], 5.0)
    with monkeypatch.context() as m:
        m.setattr(omni, "install", lambda module: lambda: None)
        m.setattr(omni, "prepare", lambda args, kwargs: (args, kwargs))
        pipe = _pipe()
        accelerate_pipeline(pipe, capture_on_miss=True, auto_breaks=False)
        assert torch.equal(_call(pipe, PROMPTS[0], 0, SIZES[0], 5.0), want)  # eagerly
        assert pipe.accel.stats()["transformer"].capture_failures > 0
        assert "pageable host-to-device copy" in pipe.accel.report()
        pipe.accel.restore()
    pipe = _pipe()
    accelerate_pipeline(pipe, capture_on_miss=True, auto_breaks=False)
    assert torch.equal(_call(pipe, PROMPTS[0], 0, SIZES[0], 5.0), want)
    stats = pipe.accel.stats()["transformer"]
    assert stats.capture_failures == 0 and stats.replays > 0 and stats.eager_calls == 0, pipe.accel.report()


@torch.no_grad()
@pytest.mark.parametrize(
    "lengths",
    [[[37], [10]], [[32], [1]], [[64, 63, 5, 33]], [[5, 40, 7], [9, 70, 2]]],
    ids=["two-samples", "exact-multiple", "one-sample-segments", "two-samples-segments"],
)
def test_padded_captions_give_the_stock_forward_bit_for_bit(lengths: list[list[int]]) -> None:
    module = build_pipeline("z-image-omni", "tiny").transformer
    dim, sig = module.config.cap_feat_dim, module.config.siglip_feat_dim
    g = torch.Generator().manual_seed(0)
    batch = len(lengths)
    images = len(lengths[0]) - 2 if len(lengths[0]) > 1 else 0  # N + 2 segments with N images
    x = [
        [torch.randn(16, 1, 4, 6, generator=g) for _ in range(images)] + [torch.randn(16, 1, 8, 8, generator=g)]
        for _ in range(batch)
    ]
    siglip = [[torch.randn(3, 5, sig, generator=g) for _ in range(images)] + [None] if images else None] * batch
    kwargs = dict(
        x=x,
        t=torch.rand(batch, generator=g),
        cap_feats=[[torch.randn(n, dim, generator=g) for n in item] for item in lengths],
        siglip_feats=siglip,
        image_noise_mask=[[0] * images + [1] for _ in range(batch)],
        return_dict=False,
    )
    ref = module(**kwargs)[0]
    recipe = ZImageRecipe()
    undo = recipe.install(module)
    try:
        args, padded = recipe.prepare((), dict(kwargs))
        assert [[c.shape[0] for c in item] for item in padded["cap_feats"]] == [
            [-(-n // 32) * 32 for n in item] for item in lengths
        ]
        assert padded[omni.LENGTHS_KWARG].tolist() == [n for item in lengths for n in item]
        out = recipe.wrap_forward(module.forward)(*args, **padded)[0]
    finally:
        undo()
    assert all(torch.equal(o, r) for o, r in zip(out, ref, strict=True))
    assert not {"patchify_and_embed_omni", "_prepare_sequence", "_build_unified_sequence"} & set(module.__dict__)


@torch.no_grad()
def test_caption_lengths_in_one_multiple_of_32_share_a_signature() -> None:
    recipe = ZImageRecipe()
    x = [[torch.randn(16, 1, 8, 8)]]

    def key(*lengths: int):
        call = dict(x=x, t=torch.rand(1), cap_feats=[[torch.randn(n, 32) for n in lengths]], image_noise_mask=[[1]])
        return flatten(*recipe.prepare((), call))[0].key

    assert len({key(33), key(40), key(64)}) == 1
    assert key(65) != key(64)
    assert len({key(3, 9, 20), key(30, 1, 32)}) == 1 and key(3, 9, 33) != key(3, 9, 20)


@pytest.mark.parametrize("images", [0, 1, 2])
def test_warmup_segments_are_the_pipelines_own(images: int) -> None:
    pipe = _pipe()
    prompt = "a lighthouse on a cliff at night"
    embeds, _ = pipe.encode_prompt(
        prompt=[prompt], device="cpu", do_classifier_free_guidance=False, num_condition_images=images
    )
    plain = ZImageRecipe().prompt_lengths(pipe, [prompt])[0]
    assert omni.segment_lengths(pipe, plain, images, 512) == [e.shape[0] for e in embeds[0]]


@pytest.mark.parametrize("images", [0, 1, 2])
def test_warmup_plains_cover_every_prompt_of_their_bucket(images: int) -> None:
    """A prompt measured at any length of a 32-token bucket lands, with condition images, in a
    multiple of 32 that the bucket's warm-up captures."""
    pipe = _pipe()
    for bucket in (32, 64, 96):
        warmed = {
            -(-omni.segment_lengths(pipe, p, images, 512)[images] // 32)
            for p in omni.warmup_plains(pipe, bucket, images, 512)
        }
        needed = {-(-omni.segment_lengths(pipe, n, images, 512)[images] // 32) for n in range(bucket - 31, bucket + 1)}
        assert needed <= warmed, (bucket, needed, warmed)


def test_front_ends_run_omni_at_its_own_defaults(tmp_path) -> None:
    """Z-Image Omni runs as its release does (50 steps, guidance 5), not as the Turbo the family's
    recipe speaks for; ``bcg-generate --model z-image-omni`` writes its image."""
    from pipelines.cli import main
    from pipelines.generation.defaults import generation_defaults

    own = generation_defaults(_pipe())
    assert (own.steps, own.guidance, own.guidance_kwarg, own.cfg_above) == (50, 5.0, "guidance_scale", 0.0)
    assert generation_defaults(build_pipeline("z-image", "tiny")).steps == 9
    out = tmp_path / "fox.png"
    argv = ["--model", "z-image-omni", "--prompt", "a fox", "--resolution", "64x64", "--steps", "2", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
