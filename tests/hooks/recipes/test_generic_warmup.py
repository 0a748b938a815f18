"""The generic warm-up on the tiny FLUX.1 and Wan2.1 pipelines (emulated CUDA graphs,
tests/helpers/emulator.py): after ``warmup(...)`` real calls at the same settings hit only
captured signatures and equal the stock pipeline bit for bit; what a pipeline's call looks like
(accel.hooks.call_shape) for each diffusers family; and the one-line refusals.
"""

from __future__ import annotations

import types

import diffusers
import numpy as np
import pytest
import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.hooks import FirstBlockCacheConfig

from accel import accelerate_pipeline
from accel.hooks import call_shape
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines

PROMPT = "a red fox in the snow"
# T5 pads every prompt to this: short keeps the tiny runs fast, and real calls must pass the same.
FAST_TEXT = dict(max_sequence_length=16)
STEPS = 2


pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    emulate_pipelines(monkeypatch)
    return monkeypatch


def _pipe(name: str, **components):
    pipe = build_pipeline(name, "tiny")
    if components:
        pipe = type(pipe)(**{**pipe.components, **components})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _all_hit(pipe) -> None:
    for name, st in pipe.accel.stats().items():
        assert st.replays > 0 and st.misses == 0 and st.eager_calls == 0, (name, st)


def _flux_call(pipe, seed: int, **kwargs) -> np.ndarray:
    out = pipe(prompt=PROMPT, height=32, width=48, num_inference_steps=STEPS, output_type="np",
               generator=torch.Generator().manual_seed(seed), **FAST_TEXT, **kwargs)  # fmt: skip
    return out.images


def _wan_call(pipe, seed: int, frames: int, guidance: float, **kwargs) -> torch.Tensor:
    out = pipe(height=32, width=32, num_frames=frames, guidance_scale=guidance, num_inference_steps=STEPS,
               output_type="latent", generator=torch.Generator().manual_seed(seed), **kwargs)  # fmt: skip
    return out.frames


def test_flux_warmup_covers_its_distilled_guidance_and_true_cfg(emulated) -> None:
    pipe = _pipe("flux")
    calls = [dict(guidance_scale=3.5), dict(guidance_scale=2.0), dict(true_cfg_scale=4.0, negative_prompt="blurry")]
    seeds = np.random.default_rng().integers(1, 2**31, size=len(calls))
    want = [_flux_call(pipe, int(s), **c) for s, c in zip(seeds, calls)]
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup(
        [(48, 32)], cfg=(True, False), prompts=[PROMPT], negative_prompt="blurry", call_kwargs=FAST_TEXT, progress=False
    )
    assert report.total_captures > 0 and all(r.frames is None for r in report.rows)
    assert "frames" not in str(report)  # images: no frames column
    captured = {name: st.captures for name, st in pipe.accel.stats().items()}
    got = [_flux_call(pipe, int(s), **c) for s, c in zip(seeds, calls)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"call {i} {calls[i]}"
    _all_hit(pipe)
    assert {name: st.captures for name, st in pipe.accel.stats().items()} == captured  # nothing new captured


def test_wan_warmup_captures_the_frames_and_guidance_of_real_calls(emulated) -> None:
    pipe = _pipe("wan")
    # A step cache keeps the guidance branches apart (a signature each), so cfg= changes what
    # the warm-up must capture; its threshold never trips on random weights.
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    calls = [(9, 5.0), (9, 1.0), (5, 5.0)]  # the call's default is 81 frames
    seeds = np.random.default_rng().integers(1, 2**31, size=len(calls))
    want = [_wan_call(pipe, int(s), f, g, prompt=PROMPT, **FAST_TEXT) for s, (f, g) in zip(seeds, calls)]
    # Wan's text encoder and VAE decoder do not capture on the emulator (a host sync in UMT5; the
    # decoder's per-frame feature cache): the denoiser is what this test is about.
    accelerate_pipeline(pipe, text_encoder=False, vae=False)
    pipe.accel.warmup([(32, 32)], num_frames=5, cfg=False, prompts=[PROMPT], call_kwargs=FAST_TEXT, progress=False)
    _wan_call(pipe, 1, 5, 5.0, prompt=PROMPT, **FAST_TEXT)
    assert pipe.accel.stats()["transformer"].misses > 0  # cfg=False captured no negative branch
    pipe.accel.release()

    report = pipe.accel.warmup(
        [(32, 32)], num_frames=[5, 9], cfg=(True, False), prompts=[PROMPT], call_kwargs=FAST_TEXT, progress=False
    )
    assert [(r.width, r.height, r.frames) for r in report.rows] == [(32, 32, 9), (32, 32, 5)]  # largest first
    assert "frames" in str(report).splitlines()[0]
    before = pipe.accel.stats()["transformer"]
    got = [_wan_call(pipe, int(s), f, g, prompt=PROMPT, **FAST_TEXT) for s, (f, g) in zip(seeds, calls)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i} {calls[i]}: max diff {(a - b).abs().max()}"
    after = pipe.accel.stats()["transformer"]
    assert after.misses == before.misses and after.eager_calls == before.eager_calls
    assert after.replays > before.replays and after.captures == before.captures
    assert after.entries == 4  # two frame counts, each with both guidance branches


def test_wan_without_a_text_encoder_warms_up_from_the_embeddings_given(emulated) -> None:
    pipe = _pipe("wan", text_encoder=None)
    dim = pipe.transformer.config.text_dim
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1, 2**31)))
    text = dict(prompt_embeds=torch.randn(1, 16, dim, generator=g), negative_prompt_embeds=torch.randn(1, 16, dim))
    want = _wan_call(pipe, 7, 5, 5.0, **text)
    accelerate_pipeline(pipe, vae=False)
    with pytest.raises(ValueError) as e:
        pipe.accel.warmup((32, 32), num_frames=5, progress=False)
    assert "WanPipeline has no text encoder" in str(e.value) and "call_kwargs=dict(prompt_embeds=" in str(e.value)
    assert "negative_prompt_embeds=" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"add negative_prompt_embeds=\.\.\. to call_kwargs"):
        pipe.accel.warmup((32, 32), num_frames=5, call_kwargs=dict(prompt_embeds=text["prompt_embeds"]))
    assert pipe.accel.stats()["transformer"].captures == 0  # refused before anything ran
    pipe.accel.warmup((32, 32), num_frames=5, cfg=True, call_kwargs=text, progress=False)
    assert torch.equal(_wan_call(pipe, 7, 5, 5.0, **text), want)
    _all_hit(pipe)


def test_bad_frames_and_call_kwargs_are_refused_in_one_line() -> None:
    flux, wan = _pipe("flux"), _pipe("wan")
    accelerate_pipeline(flux)
    accelerate_pipeline(wan)
    cases = [
        (flux, dict(num_frames=5), "FluxPipeline makes images, its call takes no num_frames"),
        (wan, dict(num_frames=0), "num_frames must be a positive integer or a list of them, got 0"),
        (wan, dict(num_frames=[5, -1]), "got \\[5, -1\\]"),
        (wan, dict(num_frames="9"), "got '9'"),
        (wan, dict(num_frames=True), "got True"),
        (wan, dict(call_kwargs=dict(max_sequence_length=16, bogus=1, strength=0.5)), "takes no bogus, strength$"),
        (wan, dict(call_kwargs=dict(width=64, guidance_scale=3.0)), "the warm-up sets width, guidance_scale itself"),
        (wan, dict(call_kwargs=[("max_sequence_length", 16)]), "call_kwargs must be a mapping"),
    ]
    for pipe, kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            pipe.accel.warmup((32, 32), progress=False, **kwargs)
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# What a call looks like, per family, against diffusers 0.42's own classes
# --------------------------------------------------------------------------------------------
def _module(**config) -> types.SimpleNamespace:
    return types.SimpleNamespace(config=FrozenDict(config))


def _bare(cls: type, config: dict | None = None, **components):
    """An instance of ``cls`` without weights: every component None but those given."""
    pipe = cls.__new__(cls)
    expected, _ = cls._get_signature_keys(cls)
    pipe.register_modules(**{name: None for name in expected})
    if config:
        pipe.register_to_config(**config)
    for name, value in components.items():
        pipe.__dict__[name] = value  # past __setattr__, which would register a stub's class
    return pipe


TEXT = object()  # a text encoder is there
FAMILIES = [
    # class, config, components, (guidance, cfg on, cfg off), default frames, needs an image
    ("FluxPipeline", None, dict(transformer=_module(guidance_embeds=True)), ("true_cfg", 4.0, 1.0), None, False),
    ("Flux2Pipeline", None, dict(transformer=_module(guidance_embeds=True)), ("distilled", None, None), None, False),
    ("Flux2KleinPipeline", dict(is_distilled=True), dict(transformer=_module()), ("none", None, None), None, False),
    ("Flux2KleinPipeline", dict(is_distilled=False), dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("StableDiffusion3Pipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("StableDiffusionXLPipeline", None, dict(unet=_module(time_cond_proj_dim=None)), ("cfg", 5.0, 1.0), None, False),
    ("StableDiffusionXLPipeline", None, dict(unet=_module(time_cond_proj_dim=256)), ("none", None, None), None, False),
    ("WanPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), 81, False),
    ("WanImageToVideoPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), 81, True),
    ("HunyuanVideoPipeline", None, dict(transformer=_module(guidance_embeds=True)), ("true_cfg", 4.0, 1.0), 129, False),
    ("LTXPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), 161, False),
    ("SanaPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("PixArtSigmaPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("ChromaPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("CogView4Pipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("HiDreamImagePipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("Lumina2Pipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, False),
    ("ZImagePipeline", None, dict(transformer=_module()), ("cfg", 5.0, 0.0), None, False),
    (
        "QwenImageEditPipeline",
        None,
        dict(transformer=_module(), processor=object()),
        ("true_cfg", 4.0, 1.0),
        None,
        True,
    ),
    # An edit pipeline's image is its starting point; Qwen-Image 2.1's is an optional condition
    # (its docstring's *optional*), though both read it through a vision-language processor.
    (
        "QwenImageEditPlusPipeline",
        None,
        dict(transformer=_module(), processor=object()),
        ("true_cfg", 4.0, 1.0),
        None,
        True,
    ),
    ("QwenImage21Pipeline", None, dict(transformer=_module(), processor=object()), ("true_cfg", 4.0, 1.0), None, False),
    ("HunyuanVideo15Pipeline", None, dict(transformer=_module(), guider=object()), ("guider", None, None), 121, False),
    ("StableDiffusion3Img2ImgPipeline", None, dict(transformer=_module()), ("cfg", 5.0, 1.0), None, True),
]


@pytest.mark.parametrize(("cls", "config", "components", "guidance", "frames", "image"), FAMILIES)
def test_call_shape_of_each_family(cls, config, components, guidance, frames, image) -> None:
    pipe = _bare(getattr(diffusers, cls), config, text_encoder=TEXT, **components)
    shape = call_shape.read_call_shape(pipe)
    assert (shape.guidance, shape.cfg_on, shape.cfg_off) == guidance
    assert shape.cfg_changes_calls == (guidance[0] in ("cfg", "true_cfg"))
    assert (shape.takes_frames, shape.default_frames) == (frames is not None, frames)
    assert shape.needs_image == image
    assert shape.has_text_encoders and "prompt_embeds" in shape.embedding_params[0]
    assert "_guidance_scale" not in vars(pipe)  # the probe put the pipeline back as it was
    assert not call_shape.read_call_shape(_bare(getattr(diffusers, cls), config, **components)).has_text_encoders


def test_warmup_image_is_random_at_the_case_size() -> None:
    a, b = call_shape.warmup_image(48, 32, seed=1), call_shape.warmup_image(48, 32, seed=2)
    assert a.size == (48, 32) and a.mode == "RGB"
    assert not np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).std() > 0


def test_given_negative_embeddings_go_without_the_pipelines_default_negative_prompt() -> None:
    # Sana and PixArt default negative_prompt to "" and refuse it beside negative_prompt_embeds.
    from accel.hooks.recipes.generic import GenericRecipe
    from accel.hooks.recipes.recipe import WARMUP_ARGUMENTS, WarmupCase
    from pipelines import zoo

    for name in ("sana", "pixart-sigma"):
        pipe = zoo.build(name, "tiny")
        given = {k: v for k, v in zoo.call_inputs(name, "tiny").items() if k not in WARMUP_ARGUMENTS}
        assert "negative_prompt_embeds" in given
        geo = zoo.family(name).geometry["tiny"]
        case = WarmupCase(geo.width, geo.height, batch_size=1, cfg=True, text="", num_inference_steps=2,
                          call_kwargs=given)  # fmt: skip
        (kwargs,) = GenericRecipe().warmup_calls(pipe, case)
        assert kwargs["negative_prompt"] is None
        out = pipe(**{**kwargs, **given}).images  # the pipeline's own check_inputs accepts the call
        assert torch.isfinite(out).all()


def test_wan_vae_decoder_replays_frame_by_frame_through_its_feature_cache(emulated) -> None:
    # The causal VAE decodes frame by frame, storing each frame's features into a list it is given
    # for the next; every replay puts them back (accel.graphs.stores), or each frame would decode
    # as the first.
    pipe = _pipe("wan")
    seed = int(np.random.default_rng().integers(1, 2**31))
    kwargs = dict(prompt=PROMPT, height=32, width=32, num_frames=9, guidance_scale=1.0, num_inference_steps=STEPS,
                  output_type="np", **FAST_TEXT)  # fmt: skip
    want = pipe(**kwargs, generator=torch.Generator().manual_seed(seed)).frames
    accelerate_pipeline(pipe, text_encoder=False)
    pipe.accel.warmup([(32, 32)], num_frames=9, cfg=False, prompts=[PROMPT], call_kwargs=FAST_TEXT, progress=False)
    before = pipe.accel.runners["vae.decoder"].stats()
    got = pipe(**kwargs, generator=torch.Generator().manual_seed(seed)).frames
    assert np.array_equal(got, want)
    decoder = pipe.accel.runners["vae.decoder"]
    after = decoder.stats()
    # Three latent frames: the first, the second (reading the first's), the third (the second's).
    assert after.captures == before.captures == 3 and not decoder.blocked, decoder.blocked
    assert after.replays - before.replays == 3 and after.eager_calls == 0
    assert pipe.accel.stats()["transformer"].replays > 0
