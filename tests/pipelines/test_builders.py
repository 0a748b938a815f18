"""Offline pipeline builders: tiny builds run end to end; full-size configs have the real shapes.

Full-size models are never materialised here (too big for CI); they are built on the meta device,
which allocates no storage, and their parameter counts checked against the released models.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3Model

from pipelines import builders
from pipelines.builders import build_pipeline, build_text_encoder, build_transformer, canonical_name, describe
from pipelines.construction import constructing_on
from pipelines.releases.configs import (
    MODEL_NAMES,
    full_transformer_config,
    scheduler_config,
    text_encoder_config,
    vae_config,
)
from pipelines.tokenizer import QWEN_IMAGE_TEMPLATE, build_tokenizer

# The two Qwen-tokenizer models; FLUX.1 and Wan2.1 are tested in tests/pipelines/test_builders_dits.py.
QWEN_MODELS = ("z-image", "qwen-image")

CLASSES = {
    "z-image": (ZImagePipeline, ZImageTransformer2DModel, Qwen3Model, AutoencoderKL),
    "qwen-image": (
        QwenImagePipeline,
        QwenImageTransformer2DModel,
        Qwen2_5_VLForConditionalGeneration,
        AutoencoderKLQwenImage,
    ),
}


pytestmark = pytest.mark.usefixtures("few_threads")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def test_tokenizer_qwen_image_prefix_is_34_tokens():
    tok = build_tokenizer()
    prefix = QWEN_IMAGE_TEMPLATE.split("{}")[0]
    assert len(tok(prefix).input_ids) == 34
    # The prompt must start right after the dropped prefix, not share a token with it.
    ids = tok(QWEN_IMAGE_TEMPLATE.format("a red fox")).input_ids
    assert ids[:34] == tok(prefix).input_ids


def test_tokenizer_is_cached_and_handles_any_text():
    tok = build_tokenizer()
    assert build_tokenizer() is tok
    ids = tok("ünïcødé 漢字 🦊 never seen in training").input_ids
    assert ids and max(ids) < len(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") < 64  # special ids fit any vocabulary


# --------------------------------------------------------------------------------------------
# Names and errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias, expected",
    [
        ("z-image", "z-image"),
        ("zimage", "z-image"),
        ("z_image", "z-image"),
        ("Z-Image", "z-image"),
        ("qwen-image", "qwen-image"),
        ("qwenimage", "qwen-image"),
        ("qwen_image", "qwen-image"),
        ("flux", "flux"),
        ("sdxl", None),
    ],
)
def test_canonical_name(alias, expected):
    assert canonical_name(alias) == expected


def test_unknown_name_raises_with_choices():
    with pytest.raises(ValueError) as info:
        build_pipeline("not a model")
    message = str(info.value)
    assert "not a model" in message
    for name in MODEL_NAMES:
        assert name in message
    assert "org/name" in message


def test_missing_folder_raises():
    with pytest.raises(ValueError, match="unknown model"):
        build_pipeline("./no/such/folder/here")


def test_bad_size_raises_with_choices():
    with pytest.raises(ValueError, match=r"unknown size 'huge'.*'tiny'.*'full'"):
        build_pipeline("z-image", size="huge")


def test_hub_id_goes_to_from_pretrained(monkeypatch):
    calls = []

    class _Stub:
        components: ClassVar[dict] = {}

        def to(self, device):
            calls.append(("to", device))
            return self

    def fake_from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        return _Stub()

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", staticmethod(fake_from_pretrained))
    build_pipeline("some-org/some-model", dtype=torch.bfloat16)
    assert calls == [("some-org/some-model", {"dtype": torch.bfloat16}), ("to", "cpu")]


def test_local_folder_round_trip(tmp_path):
    pipe = build_pipeline("z-image")
    pipe.save_pretrained(tmp_path)
    loaded = build_pipeline(tmp_path)
    assert isinstance(loaded, ZImagePipeline)
    for key, value in pipe.transformer.state_dict().items():
        assert torch.equal(value, loaded.transformer.state_dict()[key]), key


def test_default_dtype_restored_after_failed_build():
    before = torch.get_default_dtype()
    with pytest.raises(RuntimeError, match="boom"), constructing_on("cpu", torch.float16):
        assert torch.get_default_dtype() == torch.float16
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == before


# --------------------------------------------------------------------------------------------
# Tiny builds
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QWEN_MODELS)
def test_tiny_build_classes(name):
    pipe_cls, transformer_cls, text_encoder_cls, vae_cls = CLASSES[name]
    pipe = build_pipeline(name)
    assert type(pipe) is pipe_cls
    assert type(pipe.transformer) is transformer_cls
    assert type(pipe.text_encoder) is text_encoder_cls
    assert type(pipe.vae) is vae_cls
    assert pipe.tokenizer is build_tokenizer()
    assert pipe.vae_scale_factor == 8
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert not component.training
    assert _params(pipe.transformer) < 5e6  # tiny means tiny: seconds on a CPU
    assert describe(pipe).startswith(f"{pipe_cls.__name__} (transformer ")
    assert describe(pipe).endswith("M params)")


def test_tiny_build_dtype():
    pipe = build_pipeline("qwen-image", dtype=torch.bfloat16)
    assert pipe.dtype == torch.bfloat16
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pipe.text_encoder.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_z_image_pad_tokens_are_not_zero():
    transformer = build_pipeline("z-image").transformer
    assert transformer.x_pad_token.abs().sum() > 0
    assert transformer.cap_pad_token.abs().sum() > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_weights_other_seed_differs(name):
    a = build_pipeline(name, seed=0)
    b = build_pipeline(name, seed=0)
    c = build_pipeline(name, seed=1)
    sa, sb, sc = _state(a.transformer), _state(b.transformer), _state(c.transformer)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    # Each component is seeded on its own, so the text encoders agree too.
    ta, tb = _state(a.text_encoder), _state(b.text_encoder)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


CALLS = {
    # Qwen-Image: true CFG, a negative prompt makes two transformer calls per step.
    "qwen-image": dict(negative_prompt="blurry", true_cfg_scale=4.0),
    # Z-Image: CFG batches both branches into one transformer call.
    "z-image": dict(negative_prompt="blurry", guidance_scale=4.0, max_sequence_length=128),
}


@pytest.mark.parametrize("name", QWEN_MODELS)
def test_tiny_pipeline_runs_end_to_end(name):
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    common = dict(prompt="a red fox in the snow", height=64, width=64, num_inference_steps=2, **CALLS[name])

    latents = pipe(**common, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    if name == "qwen-image":
        # packed: (batch, (64/16)**2 tokens, 16 channels * 2 * 2)
        assert latents.shape == (1, 16, 64)
    else:
        assert latents.shape == (1, 16, 8, 8)
    assert torch.isfinite(latents).all()

    image = pipe(**common, output_type="pil", generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


# --------------------------------------------------------------------------------------------
# Full-size configs (meta device: shapes without storage)
# --------------------------------------------------------------------------------------------
def test_full_qwen_image_transformer_config():
    config = full_transformer_config("qwen-image")
    assert config["num_layers"] == 60
    assert config["num_attention_heads"] == 24
    assert config["attention_head_dim"] == 128
    assert config["joint_attention_dim"] == 3584
    assert config["in_channels"] == 64 and config["out_channels"] == 16 and config["patch_size"] == 2
    assert tuple(config["axes_dims_rope"]) == (16, 56, 56)
    assert config["guidance_embeds"] is False


def test_full_z_image_transformer_config():
    config = full_transformer_config("zimage")
    assert config["dim"] == 3840
    assert config["n_layers"] == 30 and config["n_refiner_layers"] == 2
    assert config["n_heads"] == 30 and config["n_kv_heads"] == 30
    assert config["cap_feat_dim"] == 2560
    assert config["in_channels"] == 16
    assert list(config["axes_dims"]) == [32, 48, 48]


@pytest.mark.parametrize("name, expected", [("qwen-image", 20.43e9), ("z-image", 6.15e9)])
def test_full_transformer_parameter_count(name, expected):
    transformer = build_transformer(name, "full", device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta for p in transformer.parameters())
    assert _params(transformer) == pytest.approx(expected, rel=0.02)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("name, expected", [("qwen-image", 8.29e9), ("z-image", 4.02e9)])
def test_full_text_encoder_parameter_count(name, expected):
    text_encoder = build_text_encoder(name, "full", device="meta", dtype=torch.bfloat16)
    assert _params(text_encoder) == pytest.approx(expected, rel=0.02)


def test_full_text_encoder_configs():
    tok = build_tokenizer()
    qwen = text_encoder_config("qwen-image", "full")
    text, vision = qwen.text_config, qwen.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (3584, 18944, 28)
    assert (text.num_attention_heads, text.num_key_value_heads) == (28, 4)
    assert text.vocab_size == 152064 and text.max_position_embeddings == 128000
    assert text.rope_parameters["rope_theta"] == 1e6
    assert list(text.rope_parameters["mrope_section"]) == [16, 24, 24]
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (32, 1280, 3420, 16)
    assert (vision.out_hidden_size, vision.patch_size, vision.spatial_merge_size) == (3584, 14, 2)
    assert (vision.temporal_patch_size, vision.window_size) == (2, 112)
    assert list(vision.fullatt_block_indexes) == [7, 15, 23, 31]
    assert qwen.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert text.pad_token_id == tok.pad_token_id

    z = text_encoder_config("z-image", "full")
    assert (z.hidden_size, z.intermediate_size, z.num_hidden_layers) == (2560, 9728, 36)
    assert (z.num_attention_heads, z.num_key_value_heads, z.head_dim) == (32, 8, 128)
    assert z.vocab_size == 151936 and z.max_position_embeddings == 40960
    assert z.rope_parameters["rope_theta"] == 1e6
    assert z.tie_word_embeddings is True
    assert z.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_full_vae_and_scheduler_configs():
    qwen_vae = vae_config("qwen-image", "full")
    assert (qwen_vae["base_dim"], qwen_vae["z_dim"], qwen_vae["num_res_blocks"]) == (96, 16, 2)
    z_vae = vae_config("z-image", "full")
    assert z_vae["block_out_channels"] == [128, 256, 512, 512]
    assert z_vae["layers_per_block"] == 2 and z_vae["latent_channels"] == 16
    assert (z_vae["scaling_factor"], z_vae["shift_factor"]) == (0.3611, 0.1159)
    assert not z_vae["use_quant_conv"] and not z_vae["use_post_quant_conv"]

    qwen_sched = scheduler_config("qwen-image")
    assert qwen_sched["use_dynamic_shifting"] and qwen_sched["time_shift_type"] == "exponential"
    assert (qwen_sched["base_shift"], qwen_sched["max_shift"], qwen_sched["shift_terminal"]) == (0.5, 0.9, 0.02)
    z_sched = scheduler_config("z-image")
    assert z_sched["shift"] == 3.0 and not z_sched["use_dynamic_shifting"]


def test_describe_uses_billions_for_big_models():
    assert builders._format_count(20_430_401_088) == "20.43B"
    assert builders._format_count(590_000) == "0.59M"
