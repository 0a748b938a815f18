"""The built-in FLUX.1 and Wan2.1 models: offline tokenizers, tiny builds that run (and equal
themselves under accelerate_pipeline, bit for bit on the CPU), full-size configs with the released
shapes (on the meta device: no storage), and bcg-generate on them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from PIL import Image
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer, UMT5EncoderModel

from accel import accelerate_pipeline
from pipelines import builders, limits
from pipelines.builders import (
    build_modules,
    build_pipeline,
    build_text_encoder,
    canonical_name,
    describe,
    pipeline_class,
)
from pipelines.cli import main
from pipelines.releases.configs import (
    scheduler_config,
    text_encoder_2_config,
    text_encoder_config,
    transformer_class,
    transformer_config,
    vae_config,
)
from pipelines.tokenizers_t5_clip import build_clip_tokenizer, build_t5_tokenizer

ANY_TEXT = "Ünïcødé 漢字 🦊 x-ray, 3.5 QUIRKY never seen in training"
PROMPT = "a red fox in the snow"
# Short T5 inputs keep the tiny runs fast; the pipelines' default (512) is what the CLI uses.
FAST_TEXT = dict(max_sequence_length=64)


pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def flux() -> FluxPipeline:
    pipe = build_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def wan() -> WanPipeline:
    pipe = build_pipeline("wan")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _flux_call(pipe: FluxPipeline, seed: int = 0, output_type: str = "np") -> np.ndarray | torch.Tensor:
    out = pipe(prompt=PROMPT, height=64, width=64, num_inference_steps=2, output_type=output_type,
               generator=torch.Generator().manual_seed(seed), **FAST_TEXT)  # fmt: skip
    return out.images


def _wan_call(pipe: WanPipeline, seed: int = 0, output_type: str = "np", frames: int = 5) -> np.ndarray | torch.Tensor:
    # Guidance 5 (Wan's default) runs CFG: two transformer calls a step, with the empty negative.
    out = pipe(prompt=PROMPT, height=64, width=64, num_frames=frames, num_inference_steps=2, output_type=output_type,
               generator=torch.Generator().manual_seed(seed), **FAST_TEXT)  # fmt: skip
    return out.frames


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------
def test_clip_tokenizer_keeps_what_flux_depends_on():
    tok = build_clip_tokenizer()
    assert isinstance(tok, CLIPTokenizer) and build_clip_tokenizer() is tok
    assert tok.model_max_length == 77  # FluxPipeline's tokenizer_max_length
    assert tok.pad_token == tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|startoftext|>"
    # The specials are the last ids, as released: the pooled output is read at the first eos.
    assert (tok.bos_token_id, tok.eos_token_id) == (len(tok) - 2, len(tok) - 1)
    ids = tok(PROMPT).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) == len(PROMPT.split()) + 2  # corpus words are whole tokens
    # Byte-level with every byte in the vocabulary: no text falls back to the unknown token
    # (which is <|endoftext|>, so it would end the pooled prompt early).
    body = tok(ANY_TEXT).input_ids[1:-1]
    assert body and tok.eos_token_id not in body and max(body) < len(tok)
    # Every character survives (CLIP's decoder puts a space after each pre-tokenized word).
    decoded = tok.decode(tok(ANY_TEXT).input_ids, skip_special_tokens=True)
    assert decoded.replace(" ", "") == ANY_TEXT.lower().replace(" ", "")
    padded = tok(["x " * 300], padding="max_length", max_length=77, truncation=True).input_ids[0]
    assert len(padded) == 77 and padded[-1] == tok.eos_token_id


def test_t5_tokenizer_keeps_what_the_pipelines_depend_on():
    tok = build_t5_tokenizer()
    assert isinstance(tok, T5Tokenizer) and build_t5_tokenizer() is tok
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.model_max_length == 512
    ids = tok(PROMPT).input_ids
    assert ids[-1] == tok.eos_token_id and len(ids) == len(PROMPT.split()) + 1
    # Any text tokenizes; characters outside the vocabulary become <unk>, as with the release.
    ids = tok(ANY_TEXT).input_ids
    assert tok.unk_token_id in ids and ids[-1] == tok.eos_token_id and max(ids) < len(tok)
    assert "QUIRKY" in tok.decode(ids, skip_special_tokens=True)  # ASCII always survives
    padded = tok([PROMPT], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    assert padded.input_ids.shape == (1, 512) and int(padded.attention_mask.sum()) == len(PROMPT.split()) + 1


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias, expected",
    [("flux", "flux"), ("FLUX.1", "flux"), ("flux.1-dev", "flux"), ("flux1", "flux"), ("wan", "wan"),
     ("Wan2.1", "wan"), ("wan2.1-t2v-14b", "wan"), ("wan-1.3b", "wan-1.3b"), ("wan2.1-1.3b", "wan-1.3b"),
     ("flux-schnell", None), ("wan2.2", None)],
)  # fmt: skip
def test_aliases(alias, expected):
    assert canonical_name(alias) == expected


def test_classes_by_name():
    assert pipeline_class("flux.1") is FluxPipeline and transformer_class("flux") is FluxTransformer2DModel
    assert pipeline_class("wan-1.3b") is WanPipeline and transformer_class("wan") is WanTransformer3DModel
    with pytest.raises(ValueError, match="unknown embedded model 'sd3'"):
        pipeline_class("sd3")
    with pytest.raises(ValueError, match="wan has one text encoder; only flux has a text_encoder_2"):
        text_encoder_2_config("wan", "tiny")


# --------------------------------------------------------------------------------------------
# Tiny builds
# --------------------------------------------------------------------------------------------
def test_tiny_flux_components(flux):
    assert type(flux.transformer) is FluxTransformer2DModel and flux.transformer.config.guidance_embeds
    assert type(flux.vae) is AutoencoderKL and flux.vae_scale_factor == 8
    assert type(flux.text_encoder) is CLIPTextModel and type(flux.text_encoder_2) is T5EncoderModel
    assert flux.tokenizer is build_clip_tokenizer() and flux.tokenizer_2 is build_t5_tokenizer()
    assert flux.tokenizer_max_length == 77
    assert type(flux.scheduler) is FlowMatchEulerDiscreteScheduler and flux.scheduler.config.use_dynamic_shifting
    # Special ids agree with the tokenizers, or the pooled CLIP output would be read elsewhere.
    assert flux.text_encoder.config.eos_token_id == flux.tokenizer.eos_token_id
    assert flux.text_encoder_2.config.pad_token_id == flux.tokenizer_2.pad_token_id == 0
    for module in (flux.transformer, flux.vae, flux.text_encoder, flux.text_encoder_2):
        assert not module.training
    assert _params(flux.transformer) < 5e6
    assert describe(flux).startswith("FluxPipeline (transformer ") and describe(flux).endswith("M params)")


def test_tiny_wan_components(wan):
    assert type(wan.transformer) is WanTransformer3DModel and wan.transformer_2 is None
    assert type(wan.vae) is AutoencoderKLWan
    assert (wan.vae_scale_factor_spatial, wan.vae_scale_factor_temporal) == (8, 4)
    assert type(wan.text_encoder) is UMT5EncoderModel and wan.tokenizer is build_t5_tokenizer()
    assert type(wan.scheduler) is UniPCMultistepScheduler
    assert wan.scheduler.config.prediction_type == "flow_prediction" and wan.scheduler.config.use_flow_sigmas
    assert wan.text_encoder.config.pad_token_id == wan.tokenizer.pad_token_id
    assert not any(m.training for m in (wan.transformer, wan.vae, wan.text_encoder))
    assert _params(wan.transformer) < 5e6
    assert describe(wan).startswith("WanPipeline (transformer ")
    # The 1.3B variant shares the tiny model: only its full size differs.
    assert transformer_config("wan-1.3b", "tiny") == transformer_config("wan", "tiny")


def test_tiny_flux_runs_with_the_right_shapes_and_seeds(flux):
    latents = _flux_call(flux, output_type="latent")
    assert latents.shape == (1, 16, 64)  # packed: (64/16)**2 tokens of 16 channels x 2 x 2
    image = _flux_call(flux)
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    assert np.array_equal(_flux_call(flux), image)
    assert not np.array_equal(_flux_call(flux, seed=1), image)


def test_tiny_wan_runs_with_the_right_shapes_and_seeds(wan):
    latents = _wan_call(wan, output_type="latent")
    assert latents.shape == (1, 16, 2, 8, 8)  # 5 frames -> 1 + 4/4 latent frames
    video = _wan_call(wan)
    assert video.shape == (1, 5, 64, 64, 3) and np.isfinite(video).all()
    assert np.array_equal(_wan_call(wan), video)
    assert not np.array_equal(_wan_call(wan, seed=1), video)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_accelerated_equals_stock_bit_for_bit(name):
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    call = _flux_call if name == "flux" else _wan_call
    stock = call(pipe)
    accelerate_pipeline(pipe)
    assert np.array_equal(call(pipe), stock)
    stats = pipe.accel.stats()["transformer"]
    # Graphs are off on a CPU: every denoiser call ran eagerly, through the runner.
    assert stats.captures == 0 and stats.eager_calls == (2 if name == "flux" else 4)
    assert pipe.accel.recipes["transformer"].name == ("flux" if name == "flux" else "generic")


def test_seeded_weights():
    a, b, c = (build_modules("flux", seed=s) for s in (0, 0, 1))
    for key in a:
        sa, sb, sc = a[key].state_dict(), b[key].state_dict(), c[key].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), key
        assert any(not torch.equal(sa[k], sc[k]) for k in sa), key


# --------------------------------------------------------------------------------------------
# Full size (meta device: the released shapes without storage)
# --------------------------------------------------------------------------------------------
def test_full_flux_dev_configs():
    t = transformer_config("flux", "full")
    assert (t["num_layers"], t["num_single_layers"]) == (19, 38)
    assert t["num_attention_heads"] * t["attention_head_dim"] == 3072 and t["guidance_embeds"] is True
    assert (t["in_channels"], t["joint_attention_dim"], t["pooled_projection_dim"]) == (64, 4096, 768)
    assert tuple(t["axes_dims_rope"]) == (16, 56, 56)
    clip, t5 = text_encoder_config("flux", "full"), text_encoder_2_config("flux", "full")
    assert (clip.hidden_size, clip.num_hidden_layers, clip.vocab_size) == (768, 12, 49408)
    assert clip.max_position_embeddings == 77
    assert (t5.d_model, t5.d_ff, t5.num_layers, t5.num_heads, t5.vocab_size) == (4096, 10240, 24, 64, 32128)
    assert t5.feed_forward_proj == "gated-gelu"
    vae = vae_config("flux", "full")
    assert vae["block_out_channels"] == [128, 256, 512, 512] and vae["latent_channels"] == 16
    assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)
    sched = scheduler_config("flux")
    assert sched["use_dynamic_shifting"] and (sched["base_shift"], sched["max_shift"]) == (0.5, 1.15)


def test_full_wan_configs():
    big, small = transformer_config("wan", "full"), transformer_config("wan-1.3b", "full")
    width = {k: c["num_attention_heads"] * c["attention_head_dim"] for k, c in (("14b", big), ("1.3b", small))}
    assert (big["num_layers"], width["14b"], big["ffn_dim"]) == (40, 5120, 13824)
    assert (small["num_layers"], width["1.3b"], small["ffn_dim"]) == (30, 1536, 8960)
    assert tuple(big["patch_size"]) == (1, 2, 2) and big["text_dim"] == 4096
    umt5 = text_encoder_config("wan", "full")
    assert (umt5.d_model, umt5.num_layers, umt5.vocab_size) == (4096, 24, 256384)
    vae = vae_config("wan", "full")
    assert (vae["base_dim"], vae["z_dim"], vae["temperal_downsample"]) == (96, 16, [False, True, True])
    assert scheduler_config("wan")["flow_shift"] == 5.0 and scheduler_config("wan-1.3b")["flow_shift"] == 3.0
    # Each call gets its own copy: a caller's edit cannot leak into the next build.
    big["num_layers"] = 1
    assert transformer_config("wan", "full")["num_layers"] == 40


@pytest.mark.parametrize(
    "name, expected",
    [
        # FLUX.1-dev: transformer 11.9B, CLIP-L text 123M, T5-XXL encoder 4.76B, VAE 84M.
        ("flux", {"transformer": 11.90e9, "text_encoder": 0.123e9, "text_encoder_2": 4.76e9, "vae": 0.084e9}),
        # Wan2.1-T2V-14B: transformer 14.3B, UMT5-XXL encoder 5.68B, VAE 127M; the 1.3B: 1.42B.
        ("wan", {"transformer": 14.29e9, "text_encoder": 5.68e9, "vae": 0.127e9}),
        ("wan-1.3b", {"transformer": 1.42e9, "text_encoder": 5.68e9, "vae": 0.127e9}),
    ],
)
def test_full_parameter_counts(name, expected):
    modules = build_modules(name, "full", device="meta", dtype=torch.bfloat16)
    assert set(modules) == set(expected)
    for key, count in expected.items():
        assert all(p.is_meta for p in modules[key].parameters()), key
        assert _params(modules[key]) == pytest.approx(count, rel=0.01), key
    assert torch.get_default_dtype() == torch.float32
    # The weight count of the memory checks includes every text encoder.
    total = limits.embedded_weight_bytes(name, "full", torch.bfloat16)
    assert total == pytest.approx(2 * sum(expected.values()), rel=0.01)


def test_full_flux_beyond_free_memory_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch):
    real = builders.build_text_encoder

    def meta_only(*args, device="cpu", **kwargs):
        assert str(device) == "meta", "allocated before the check"
        return real(*args, device=device, **kwargs)

    monkeypatch.setattr(builders, "build_text_encoder", meta_only)
    monkeypatch.setattr(limits, "available_memory", lambda device: 2**30)
    with pytest.raises(limits.LimitError, match=r"^flux at size 'full' has 62\.\d GiB of weights in float32"):
        build_pipeline("flux", size="full")


def test_text_encoder_2_alone():
    t5 = build_text_encoder("flux", device="meta", component="text_encoder_2")
    assert type(t5) is T5EncoderModel and t5.config.d_model == 32
    assert limits.embedded_position_limit("flux", "full") is None  # rotary positions computed per call
    assert limits.embedded_position_limit("wan", "full") is None


# --------------------------------------------------------------------------------------------
# bcg-generate
# --------------------------------------------------------------------------------------------
def _png(path: Path) -> tuple[tuple[int, int], dict[str, str]]:
    with Image.open(path) as im:
        im.load()
        return im.size, dict(im.text)


FAST_CLI = ["--resolution", "64x64", "--steps", "2", "--quiet"]


def test_cli_flux_writes_an_image(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    out = tmp_path / "flux.png"
    assert main(["--model", "flux.1", "--negative-prompt", "blurry", "--out", str(out), *FAST_CLI]) == 0
    size, meta = _png(out)
    assert size == (64, 64)
    assert (meta["model"], meta["steps"], meta["guidance"]) == ("flux.1", "2", "3.5")  # FLUX.1-dev's guidance
    assert meta["negative_prompt"] == "" and "frames" not in meta
    assert "distilled guidance embedding, not classifier-free guidance" in caplog.text


def test_cli_wan_writes_the_first_frame(tmp_path: Path):
    out = tmp_path / "wan.png"
    assert main(["--model", "wan", "--frames", "5", "--seed", "4", "--out", str(out), *FAST_CLI]) == 0
    size, meta = _png(out)
    assert size == (64, 64)
    assert (meta["guidance"], meta["frames"], meta["seed"]) == ("5", "5 generated, the first written", "4")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "wan", "--frames", "6"], "--frames 6: WanPipeline's VAE packs 4 frames into each latent frame "
         "after the first, so a video has 4k+1 frames: use 5 or 9"),
        (["--model", "z-image", "--frames", "5"], "--frames 5: ZImagePipeline makes images, not videos"),
        (["--model", "flux", "--frames", "0"], "argument --frames: must be at least 1, got 0"),
        (["--model", "wan", "--size", "full"], "--size full needs a CUDA GPU (wan's weights take"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_frames_before_building(argv, expected, tmp_path, capsys, monkeypatch):
    from pipelines.generation import prepare as generation_prepare

    def no_build(*args, **kwargs):
        raise AssertionError("this bad input must be refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    assert main([*argv, "--out", str(tmp_path / "out"), "--device", "cpu", *FAST_CLI]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_cli_default_sizes_per_model():
    from pipelines.generation.defaults import default_resolution

    assert default_resolution("wan", "full") == (832, 480)  # Wan2.1's 480p
    assert default_resolution("wan-1.3b", "tiny") == (256, 256)
    assert default_resolution("flux", "full") == default_resolution("z-image", "tiny") == (512, 512)
    assert default_resolution("some-org/some-video-model", "tiny") == (512, 512)
