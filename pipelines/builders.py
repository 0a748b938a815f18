"""Offline builders for Qwen-Image, Z-Image, FLUX.1 and Wan2.1 pipelines with random weights.

Two sizes of each embedded model:

* ``"tiny"``: a few layers and narrow widths, built in seconds on a CPU. Used by the CPU tests and
  as the CLI's default, where only the structure of the denoising loop matters.
* ``"full"``: the released models' shapes (Qwen-Image 20B with a Qwen2.5-VL-7B text encoder,
  Z-Image 6B with a Qwen3-4B text encoder, FLUX.1-dev 12B with CLIP-L and T5-XXL, Wan2.1-T2V 14B
  or 1.3B with UMT5-XXL), for GPU benchmarks. The weights are random, so the images are noise,
  but every kernel has its real size and count.

Only widths and depths differ between the sizes; the structural choices the pipelines depend on
(VAE scale factor 8, 16 latent channels, patch sizes, Qwen-Image's 34-token system prefix, FLUX's
guidance embedding, Wan's causal video VAE, the text encoder families) are those of the real
checkpoints. Nothing is downloaded: the tokenizers are made in-process (see
:mod:`pipelines.tokenizer` and :mod:`pipelines.tokenizers_t5_clip`).

Any other name is handed to ``DiffusionPipeline.from_pretrained`` (a local folder or a hub id),
so callers can use one entry point for random and real weights::

    pipe = build_pipeline("z-image", size="full", device="cuda", dtype=torch.bfloat16)
    pipe = build_pipeline("Tongyi-MAI/Z-Image-Turbo", device="cuda", dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from .tokenizer import build_tokenizer, special_token_ids
from .tokenizers_t5_clip import CLIP_MAX_LENGTH, build_clip_tokenizer, build_t5_tokenizer

__all__ = [
    "MODEL_NAMES",
    "SIZES",
    "as_dtype",
    "build_modules",
    "build_pipeline",
    "build_scheduler",
    "build_text_encoder",
    "build_text_encoder_2",
    "build_tokenizer",
    "build_tokenizers",
    "build_transformer",
    "build_vae",
    "canonical_name",
    "constructing_on",
    "describe",
    "full_transformer_config",
    "init_defaults",
    "pipeline_class",
    "scheduler_config",
    "seeded",
    "text_encoder_2_config",
    "text_encoder_config",
    "transformer_class",
    "transformer_config",
    "vae_config",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=torch.nn.Module)

# "flux" is FLUX.1-dev; "wan" is Wan2.1-T2V-14B and "wan-1.3b" its 1.3B sibling (the same tiny
# model: the two differ only in widths and depths).
MODEL_NAMES: tuple[str, ...] = ("z-image", "qwen-image", "flux", "wan", "wan-1.3b")
SIZES: tuple[str, ...] = ("tiny", "full")

_ALIASES: dict[str, str] = {
    "z-image": "z-image",
    "zimage": "z-image",
    "z_image": "z-image",
    "qwen-image": "qwen-image",
    "qwenimage": "qwen-image",
    "qwen_image": "qwen-image",
    "flux": "flux",
    "flux.1": "flux",
    "flux1": "flux",
    "flux-dev": "flux",
    "flux.1-dev": "flux",
    "flux1-dev": "flux",
    "wan": "wan",
    "wan2.1": "wan",
    "wan-14b": "wan",
    "wan2.1-14b": "wan",
    "wan2.1-t2v-14b": "wan",
    "wan-1.3b": "wan-1.3b",
    "wan2.1-1.3b": "wan-1.3b",
    "wan2.1-t2v-1.3b": "wan-1.3b",
}

# The models that share a pipeline, tokenizer and tiny size under one family name.
_FAMILIES: dict[str, str] = {"wan-1.3b": "wan"}

# By name, imported on first use (see pipeline_class).
_PIPELINES: dict[str, str] = {
    "z-image": "ZImagePipeline",
    "qwen-image": "QwenImagePipeline",
    "flux": "FluxPipeline",
    "wan": "WanPipeline",
}
_TRANSFORMERS: dict[str, type[torch.nn.Module]] = {
    "z-image": ZImageTransformer2DModel,
    "qwen-image": QwenImageTransformer2DModel,
    "flux": FluxTransformer2DModel,
    "wan": WanTransformer3DModel,
}
_VAES: dict[str, type[torch.nn.Module]] = {
    "z-image": AutoencoderKL,  # the FLUX.1 VAE
    "qwen-image": AutoencoderKLQwenImage,
    "flux": AutoencoderKL,
    "wan": AutoencoderKLWan,
}
_TEXT_ENCODERS: dict[str, type[torch.nn.Module]] = {
    "z-image": Qwen3Model,
    "qwen-image": Qwen2_5_VLForConditionalGeneration,
    "flux": CLIPTextModel,  # FLUX reads only its pooled output; T5 is text_encoder_2
    "wan": UMT5EncoderModel,
}

# A hub repo id is "org/name" with exactly one slash; anything else that is not an existing folder
# is a typo, and from_pretrained's own error for it (a failed download) would hide that.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

# Tiny text encoders are this wide; the tiny transformers' text input width must match.
_TINY_TEXT_HIDDEN = 32


def canonical_name(name: str) -> str | None:
    """Return the embedded model ``name`` refers to (one of :data:`MODEL_NAMES`), or None."""
    return _ALIASES.get(name.strip().lower())


def _family(model: str) -> str:
    return _FAMILIES.get(model, model)


def pipeline_class(name: str) -> type[DiffusionPipeline]:
    """The diffusers pipeline class of the embedded model ``name``."""
    import diffusers

    # FluxPipeline's package imports CLIP and SigLIP image processors for its optional image
    # inputs, and without torchvision transformers warns, once per process, that it falls back
    # to their PIL versions. Text-to-image never uses them, so that warning would only be noise
    # on every FLUX run. Imported here rather than at the top, so other runs never import it.
    quiet = logging.getLogger("transformers.utils.import_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return getattr(diffusers, _PIPELINES[_family(_require_model(name))])
    finally:
        quiet.setLevel(level)


def transformer_class(name: str) -> type[torch.nn.Module]:
    """The denoiser class of the embedded model ``name``."""
    return _TRANSFORMERS[_family(_require_model(name))]


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(map(repr, SIZES))}")
    return size


def _require_model(name: str) -> str:
    model = canonical_name(name)
    if model is None:
        raise ValueError(f"unknown embedded model {name!r}: expected one of {', '.join(map(repr, MODEL_NAMES))}")
    return model


def init_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls.__init__``: diffusers' defaults are the released configs.

    Deep-copied because diffusers declares some defaults as shared mutable lists.
    """
    params = inspect.signature(cls.__init__).parameters
    return {
        k: copy.deepcopy(p.default)
        for k, p in params.items()
        if k != "self" and p.default is not inspect.Parameter.empty
    }


def _padded_vocab(n_tokens: int) -> int:
    # Rounded up like the real vocabularies (multiples of 64) so embedding shapes stay aligned.
    return ((n_tokens + 63) // 64) * 64


# --------------------------------------------------------------------------------------------
# FLUX.1 and Wan2.1: the released configs as data, and what the tiny size changes
# --------------------------------------------------------------------------------------------
# FLUX.1-dev (black-forest-labs/FLUX.1-dev, transformer/config.json): 19 double-stream and 38
# single-stream blocks, 24 heads x 128 = 3072 wide, packed 2x2 latent patches (64 = 16 x 4 input
# channels), T5-XXL text (4096) and pooled CLIP-L (768) conditioning, and the distilled guidance
# embedding (FLUX.1-schnell has none).
_FLUX_DEV_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
_TINY_FLUX_TRANSFORMER: dict[str, Any] = dict(
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,  # must equal sum(axes_dims_rope)
    num_attention_heads=2,
    joint_attention_dim=_TINY_TEXT_HIDDEN,
    pooled_projection_dim=_TINY_TEXT_HIDDEN,
    axes_dims_rope=(4, 6, 6),
)
# FLUX.1-dev scheduler/scheduler_config.json: the shift grows with the image's token count.
_FLUX_DEV_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
# FLUX.1-dev text_encoder/config.json: the text tower of openai/clip-vit-large-patch14.
_CLIP_L_TEXT: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=CLIP_MAX_LENGTH,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)
_TINY_CLIP_TEXT: dict[str, Any] = dict(
    hidden_size=_TINY_TEXT_HIDDEN,
    intermediate_size=64,
    projection_dim=_TINY_TEXT_HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=2,
)
# FLUX.1-dev text_encoder_2/config.json: the encoder of google/t5-v1_1-xxl.
_T5_V1_1_XXL: dict[str, Any] = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)
# Wan2.1 text_encoder/config.json (both sizes): the encoder of google/umt5-xxl, T5-XXL's shapes
# with a 256k multilingual vocabulary and a relative position bias in every layer.
_UMT5_XXL: dict[str, Any] = {**_T5_V1_1_XXL, "vocab_size": 256384}
_TINY_T5: dict[str, Any] = dict(d_model=_TINY_TEXT_HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2)

# Wan2.1-T2V-14B (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json): 40 layers, 40 heads
# x 128 = 5120 wide, FFN 13824, 1x2x2 patches of the 16-channel video latents, UMT5-XXL text.
_WAN_14B_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
# Wan2.1-T2V-1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json): 30 layers, 12
# heads x 128 = 1536 wide, FFN 8960; everything else as the 14B.
_WAN_1_3B_TRANSFORMER: dict[str, Any] = {
    **_WAN_14B_TRANSFORMER,
    "num_attention_heads": 12,
    "ffn_dim": 8960,
    "num_layers": 30,
}
_TINY_WAN_TRANSFORMER: dict[str, Any] = dict(
    num_attention_heads=2,
    attention_head_dim=16,  # Wan's RoPE splits it 8 (frames) + 4 + 4 (rows, columns)
    text_dim=_TINY_TEXT_HIDDEN,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
)
# Wan2.1 vae/config.json (both sizes): the causal 3D VAE, 4x in time and 8x in space (three
# spatial downsamples, the last two also temporal). latents_mean / latents_std are diffusers'
# defaults of AutoencoderKLWan, which are Wan2.1's.
_WAN_VAE: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],  # sic: diffusers' spelling
)
# Wan2.1 scheduler/scheduler_config.json: UniPC on flow-matching sigmas. flow_shift: 5.0 for the
# 14B (the sample_shift of Wan's generate.py for text-to-video), 3.0 for the 1.3B (diffusers' Wan
# docs: 3.0 for 480p, 5.0 for 720p). It only spaces the timesteps; no shape depends on it.
_WAN_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=5.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    final_sigmas_type="zero",
    timestep_spacing="linspace",
)
_WAN_1_3B_FLOW_SHIFT = 3.0


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------
def transformer_config(name: str, size: str) -> dict[str, Any]:
    """Constructor kwargs of the denoiser of ``name`` at ``size``."""
    model, size = _require_model(name), _check_size(size)
    tiny = size == "tiny"
    if model == "flux":
        return copy.deepcopy({**_FLUX_DEV_TRANSFORMER, **(_TINY_FLUX_TRANSFORMER if tiny else {})})
    if _family(model) == "wan":
        full = _WAN_1_3B_TRANSFORMER if model == "wan-1.3b" else _WAN_14B_TRANSFORMER
        return copy.deepcopy({**full, **(_TINY_WAN_TRANSFORMER if tiny else {})})
    if model == "qwen-image":
        # Full: 60 layers, 24 heads x 128, joint_attention_dim 3584 (= Qwen2.5-VL-7B width).
        config = init_defaults(QwenImageTransformer2DModel)
        if size == "tiny":
            config.update(
                num_layers=2,
                attention_head_dim=32,  # must equal sum(axes_dims_rope)
                num_attention_heads=2,
                joint_attention_dim=_TINY_TEXT_HIDDEN,
                axes_dims_rope=(8, 12, 12),
            )
        return config
    # Full: dim 3840, 30 layers + 2 refiner layers, 30 heads x 128, cap_feat_dim 2560 (= Qwen3-4B).
    config = init_defaults(ZImageTransformer2DModel)
    if size == "tiny":
        config.update(
            dim=64,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=_TINY_TEXT_HIDDEN,
            axes_dims=[8, 12, 12],  # must sum to the head dim (64 / 2)
        )
    return config


def full_transformer_config(name: str) -> dict[str, Any]:
    """Constructor kwargs of the released denoiser of ``name`` (random weights, real shapes)."""
    return transformer_config(name, "full")


def vae_config(name: str, size: str) -> dict[str, Any]:
    """Constructor kwargs of the VAE of ``name`` at ``size``."""
    model, size = _require_model(name), _check_size(size)
    tiny = size == "tiny"
    if _family(model) == "wan":
        config = init_defaults(AutoencoderKLWan)
        config.update(copy.deepcopy(_WAN_VAE))
        if tiny:
            config.update(base_dim=16, num_res_blocks=1)
        return config
    if model == "qwen-image":
        # Defaults are the release: base_dim 96, z_dim 16, 2 res blocks, temporal downsampling on
        # the last two stages (three spatial downsamples -> vae_scale_factor 8).
        config = init_defaults(AutoencoderKLQwenImage)
        if size == "tiny":
            config.update(base_dim=16, num_res_blocks=1)
        return config
    # FLUX.1-dev vae/config.json, which Z-Image ships too: 4 blocks (scale factor 8), 16 latent
    # channels, no quant convs.
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[16, 16, 32, 32] if tiny else [128, 256, 512, 512],
        layers_per_block=1 if tiny else 2,
        act_fn="silu",
        latent_channels=16,
        norm_num_groups=8 if tiny else 32,
        sample_size=128 if tiny else 1024,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def scheduler_config(name: str) -> dict[str, Any]:
    """Constructor kwargs of the released scheduler of ``name`` (the same at both sizes).

    Wan2.1's is a :class:`UniPCMultistepScheduler`, the others' a FlowMatchEulerDiscreteScheduler.
    """
    model = _require_model(name)
    if model == "flux":
        return dict(_FLUX_DEV_SCHEDULER)
    if _family(model) == "wan":
        config = dict(_WAN_SCHEDULER)
        if model == "wan-1.3b":
            config["flow_shift"] = _WAN_1_3B_FLOW_SHIFT
        return config
    if model == "qwen-image":
        # Qwen-Image's published scheduler_config: resolution-dependent shift, exponential form.
        return dict(
            num_train_timesteps=1000,
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
            invert_sigmas=False,
        )
    return dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def _clip_text_config(size: str, tok: PreTrainedTokenizerBase) -> CLIPTextConfig:
    config = dict(_CLIP_L_TEXT)
    if size == "tiny":
        config.update(_TINY_CLIP_TEXT, vocab_size=_padded_vocab(len(tok)))
    # The pooled output is read at the first eos of each row, so eos must be the tokenizer's.
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return CLIPTextConfig(**config, **ids)


def _t5_config(cls: type[T5Config] | type[UMT5Config], full: dict[str, Any], size: str,
               tok: PreTrainedTokenizerBase) -> PreTrainedConfig:  # fmt: skip
    config = dict(full)
    if size == "tiny":
        config.update(_TINY_T5, vocab_size=_padded_vocab(len(tok)))
    return cls(**config, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def text_encoder_config(name: str, size: str, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedConfig:
    """Config of the (first) text encoder of ``name`` at ``size``.

    Special token ids are those of ``tokenizer`` (the model's offline one by default), so
    generation-side ids (pad, eos, image tokens) agree with what the pipeline's tokenizer produces.
    """
    model, size = _require_model(name), _check_size(size)
    if model == "flux":
        return _clip_text_config(size, tokenizer if tokenizer is not None else build_clip_tokenizer())
    if _family(model) == "wan":
        return _t5_config(UMT5Config, _UMT5_XXL, size, tokenizer if tokenizer is not None else build_t5_tokenizer())
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    ids = special_token_ids(tok)
    token_ids = dict(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    tiny = size == "tiny"

    if model == "qwen-image":
        if tiny:
            text = dict(
                hidden_size=_TINY_TEXT_HIDDEN,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=4096,
                vocab_size=_padded_vocab(len(tok)),
                # head_dim 16: the three M-RoPE sections must sum to head_dim / 2
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
            )
            vision = dict(
                depth=1,
                hidden_size=32,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=_TINY_TEXT_HIDDEN,
            )
        else:  # Qwen2.5-VL-7B-Instruct
            text = dict(
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                max_position_embeddings=128000,
                vocab_size=152064,
                rms_norm_eps=1e-6,
                use_sliding_window=False,
                sliding_window=32768,
                max_window_layers=28,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
            )
            vision = dict(
                depth=32,
                hidden_size=1280,
                intermediate_size=3420,
                num_heads=16,
                in_channels=3,
                out_hidden_size=3584,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                tokens_per_second=2,
                window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31],
            )
        return Qwen2_5_VLConfig(
            text_config={**text, **token_ids},
            vision_config=vision,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )

    if tiny:
        # ZImagePipeline reads hidden_states[-2], so at least two layers.
        return Qwen3Config(
            hidden_size=_TINY_TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=_padded_vocab(len(tok)),
            max_position_embeddings=1024,
            **token_ids,
        )
    return Qwen3Config(  # Qwen3-4B
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=36,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **token_ids,
    )


def text_encoder_2_config(name: str, size: str, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedConfig:
    """Config of the second text encoder of ``name`` at ``size``: FLUX.1's T5-XXL, the only one."""
    model, size = _require_model(name), _check_size(size)
    if model != "flux":
        raise ValueError(f"{model} has one text encoder; only flux has a text_encoder_2")
    return _t5_config(T5Config, _T5_V1_1_XXL, size, tokenizer if tokenizer is not None else build_t5_tokenizer())


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------
def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` ("bfloat16", "torch.float32" or a dtype); ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


@contextlib.contextmanager
def constructing_on(device: str | torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly on ``device`` in ``dtype``.

    Initialising a 20B model on the CPU in fp32 and then moving it would take minutes and twice
    its final memory; constructing in place takes seconds. The global default dtype is restored
    even if construction fails, because it leaks into every later tensor factory call.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def seeded(make: Callable[[], M], device: str | torch.device, dtype: torch.dtype | str, seed: int) -> M:
    """``make()`` with the torch seed set to ``seed`` and its parameters created on ``device`` in
    ``dtype`` (:func:`constructing_on`), in eval mode: every builder's random weights."""
    torch.manual_seed(seed)
    with constructing_on(device, as_dtype(dtype)):
        module = make()
    return module.eval()


def build_transformer(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The denoiser of ``name`` with random weights (``device="meta"`` builds no storage)."""
    model, config = _require_model(name), transformer_config(name, size)
    cls = transformer_class(model)
    transformer = seeded(lambda: cls(**config), device, dtype, seed)
    if model == "z-image":
        # The pad tokens are learned and attended to; left at their zero init they would make
        # padding numerically invisible and hide padding bugs.
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
    return transformer


def build_vae(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The VAE of ``name`` with random weights."""
    model, config = _require_model(name), vae_config(name, size)
    cls = _VAES[_family(model)]
    return seeded(lambda: cls(**config), device, dtype, seed)


def build_text_encoder(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> torch.nn.Module:
    """The (first) text encoder of ``name`` with random weights: Qwen2.5-VL, Qwen3, CLIP-L or UMT5."""
    model, config = _require_model(name), text_encoder_config(name, size, tokenizer)
    cls = _TEXT_ENCODERS[_family(model)]
    return seeded(lambda: cls(config), device, dtype, seed)


def build_text_encoder_2(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> torch.nn.Module:
    """FLUX.1's second text encoder (T5-XXL's encoder) with random weights; ValueError for others."""
    config = text_encoder_2_config(name, size, tokenizer)
    return seeded(lambda: T5EncoderModel(config), device, dtype, seed)


def build_scheduler(name: str) -> SchedulerMixin:
    """The released scheduler of ``name`` (no weights, so no size)."""
    model = _require_model(name)
    cls = UniPCMultistepScheduler if _family(model) == "wan" else FlowMatchEulerDiscreteScheduler
    return cls(**scheduler_config(model))


def build_tokenizers(name: str) -> dict[str, PreTrainedTokenizerBase]:
    """The offline tokenizers of ``name``, by pipeline component name (shared objects: do not mutate)."""
    family = _family(_require_model(name))
    if family == "flux":
        return dict(tokenizer=build_clip_tokenizer(), tokenizer_2=build_t5_tokenizer())
    if family == "wan":
        return dict(tokenizer=build_t5_tokenizer())
    return dict(tokenizer=build_tokenizer())


def build_modules(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizers: dict[str, PreTrainedTokenizerBase] | None = None,
) -> dict[str, torch.nn.Module]:
    """Every component of ``name`` that has weights, by pipeline component name, each seeded with
    ``seed`` on its own (``device="meta"`` builds no storage, to count bytes)."""
    model = _require_model(name)
    toks = tokenizers if tokenizers is not None else build_tokenizers(model)
    kwargs: dict[str, Any] = dict(size=size, device=device, dtype=dtype, seed=seed)
    modules = dict(
        transformer=build_transformer(model, **kwargs),
        vae=build_vae(model, **kwargs),
        text_encoder=build_text_encoder(model, tokenizer=toks["tokenizer"], **kwargs),
    )
    if "tokenizer_2" in toks:
        modules["text_encoder_2"] = build_text_encoder_2(model, tokenizer=toks["tokenizer_2"], **kwargs)
    return modules


# --------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------
def _check_room(model: str, size: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """LimitError when ``model``'s weights at ``size`` cannot fit ``device``'s free memory.

    Without it, the full-size models on a CPU (Z-Image 38 GiB in float32) fill the host until the
    kernel kills the process: exit 137 and no message. The tiny models always fit.
    """
    from . import limits

    if size == "tiny":
        return
    target = torch.device(device)
    free = limits.available_memory(target)
    if free is None:
        return
    need = limits.embedded_weight_bytes(model, size, dtype)
    if need > free:
        raise limits.LimitError(
            f"{model} at size {size!r} has {limits.format_bytes(need)} of weights in "
            f"{str(dtype).removeprefix('torch.')} but {target} has {limits.format_bytes(free)} free; "
            "size='tiny' builds in seconds anywhere"
        )


def _build_embedded(
    model: str, size: str, device: str | torch.device, dtype: torch.dtype, seed: int
) -> DiffusionPipeline:
    _check_room(model, size, device, dtype)
    tokenizers = build_tokenizers(model)
    modules = build_modules(model, size=size, device=device, dtype=dtype, seed=seed, tokenizers=tokenizers)
    pipe = pipeline_class(model)(**modules, **tokenizers, scheduler=build_scheduler(model))
    # Components are already in `dtype`: casting again would turn the fp32 rotary buffers that
    # transformers keeps on purpose (and from_pretrained leaves alone) into low precision. Only
    # the device move remains, for the few tensors created outside the construction context.
    return pipe.to(device)


def build_pipeline(
    name: str | os.PathLike[str],
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> DiffusionPipeline:
    """Build a pipeline by name.

    ``name`` is an embedded model (one of :data:`MODEL_NAMES` or an alias such as "zimage",
    "flux.1", "wan2.1"), built offline with random weights at ``size`` ("tiny" or "full") and seeded
    with ``seed``; or a local pipeline folder or hub id, loaded with ``from_pretrained`` (``size``
    and ``seed`` do not apply). The pipeline is in eval mode on ``device`` in ``dtype``.

    An embedded model whose weights do not fit ``device``'s free memory raises
    :class:`pipelines.limits.LimitError` (a ValueError) before anything is allocated.
    """
    _check_size(size)
    dtype = as_dtype(dtype)
    name = os.fspath(name)
    model = canonical_name(name)
    start = time.perf_counter()
    if model is not None:
        pipe = _build_embedded(model, size, device, dtype, seed)
        source = f"{model} ({size}, random weights, seed {seed})"
    elif os.path.isdir(name) or _HUB_ID.match(name):
        # `dtype`, not `torch_dtype`: diffusers 0.42 deprecates the latter with a warning.
        pipe = DiffusionPipeline.from_pretrained(name, dtype=dtype).to(device)
        source = name
    else:
        aliases = sorted(a for a in _ALIASES if a not in MODEL_NAMES)
        raise ValueError(
            f"unknown model {name!r}: expected one of {', '.join(map(repr, MODEL_NAMES))} "
            f"(aliases: {', '.join(aliases)}), an existing pipeline folder, "
            f"or a Hugging Face hub id like 'org/name'"
        )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    logger.info("built %s from %s in %.1f s", describe(pipe), source, time.perf_counter() - start)
    return pipe


def _format_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.2f}M"


def describe(pipe: DiffusionPipeline) -> str:
    """One line naming the pipeline and its denoiser's size.

    For example "ZImagePipeline (transformer 0.59M params)".
    """
    for attr in ("transformer", "unet"):
        denoiser = getattr(pipe, attr, None)
        if isinstance(denoiser, torch.nn.Module):
            n = sum(p.numel() for p in denoiser.parameters())
            return f"{type(pipe).__name__} ({attr} {_format_count(n)} params)"
    return type(pipe).__name__
