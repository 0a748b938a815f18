"""Offline builders for Qwen-Image and Z-Image pipelines with random weights.

Two sizes of each embedded model:

* ``"tiny"``: a few layers and narrow widths, built in seconds on a CPU. Used by the CPU tests and
  as the CLI's default, where only the structure of the denoising loop matters.
* ``"full"``: the released models' shapes (Qwen-Image 20B with a Qwen2.5-VL-7B text encoder,
  Z-Image 6B with a Qwen3-4B text encoder), for GPU benchmarks. The weights are random, so the
  images are noise, but every kernel has its real size and count.

Only widths and depths differ between the sizes; the structural choices the pipelines depend on
(VAE scale factor 8, 16 latent channels, patch size 2, Qwen-Image's 34-token system prefix, the
text encoder families) are those of the real checkpoints. Nothing is downloaded: the tokenizer is
trained in-process (see :mod:`pipelines.tokenizer`).

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
from collections.abc import Iterator
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    PreTrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
)

from .tokenizer import build_tokenizer, special_token_ids

__all__ = [
    "MODEL_NAMES",
    "SIZES",
    "build_pipeline",
    "build_text_encoder",
    "build_tokenizer",
    "build_transformer",
    "build_vae",
    "canonical_name",
    "describe",
    "full_transformer_config",
    "scheduler_config",
    "text_encoder_config",
    "transformer_config",
    "vae_config",
]

logger = logging.getLogger(__name__)

MODEL_NAMES: tuple[str, ...] = ("z-image", "qwen-image")
SIZES: tuple[str, ...] = ("tiny", "full")

_ALIASES: dict[str, str] = {
    "z-image": "z-image",
    "zimage": "z-image",
    "z_image": "z-image",
    "qwen-image": "qwen-image",
    "qwenimage": "qwen-image",
    "qwen_image": "qwen-image",
}

# A hub repo id is "org/name" with exactly one slash; anything else that is not an existing folder
# is a typo, and from_pretrained's own error for it (a failed download) would hide that.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

# Tiny text encoders are this wide; the tiny transformers' text input width must match.
_TINY_TEXT_HIDDEN = 32


def canonical_name(name: str) -> str | None:
    """Return the embedded model ``name`` refers to ("z-image" or "qwen-image"), or None."""
    return _ALIASES.get(name.strip().lower())


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(map(repr, SIZES))}")
    return size


def _require_model(name: str) -> str:
    model = canonical_name(name)
    if model is None:
        raise ValueError(f"unknown embedded model {name!r}: expected one of {', '.join(map(repr, MODEL_NAMES))}")
    return model


def _init_defaults(cls: type) -> dict[str, Any]:
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
# Configs
# --------------------------------------------------------------------------------------------
def transformer_config(name: str, size: str) -> dict[str, Any]:
    """Constructor kwargs of the denoiser of ``name`` at ``size``."""
    model, size = _require_model(name), _check_size(size)
    if model == "qwen-image":
        # Full: 60 layers, 24 heads x 128, joint_attention_dim 3584 (= Qwen2.5-VL-7B width).
        config = _init_defaults(QwenImageTransformer2DModel)
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
    config = _init_defaults(ZImageTransformer2DModel)
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
    if model == "qwen-image":
        # Defaults are the release: base_dim 96, z_dim 16, 2 res blocks, temporal downsampling on
        # the last two stages (three spatial downsamples -> vae_scale_factor 8).
        config = _init_defaults(AutoencoderKLQwenImage)
        if size == "tiny":
            config.update(base_dim=16, num_res_blocks=1)
        return config
    # Z-Image uses the Flux VAE: 4 blocks (scale factor 8), 16 latent channels, no quant convs.
    tiny = size == "tiny"
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
    """Constructor kwargs of the released scheduler of ``name`` (the same at both sizes)."""
    model = _require_model(name)
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


def text_encoder_config(name: str, size: str, tokenizer: Qwen2Tokenizer | None = None) -> PreTrainedConfig:
    """Config of the text encoder of ``name`` at ``size``.

    Special token ids are those of ``tokenizer`` (the offline one by default), so generation-side
    ids (pad, eos, image tokens) agree with what the pipeline's tokenizer produces.
    """
    model, size = _require_model(name), _check_size(size)
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


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------
def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


@contextlib.contextmanager
def _constructing_on(device: str | torch.device, dtype: torch.dtype) -> Iterator[None]:
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


def build_transformer(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The denoiser of ``name`` with random weights (``device="meta"`` builds no storage)."""
    model, config = _require_model(name), transformer_config(name, size)
    cls = QwenImageTransformer2DModel if model == "qwen-image" else ZImageTransformer2DModel
    torch.manual_seed(seed)
    with _constructing_on(device, _as_dtype(dtype)):
        transformer = cls(**config)
    if model == "z-image":
        # The pad tokens are learned and attended to; left at their zero init they would make
        # padding numerically invisible and hide padding bugs.
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
    return transformer.eval()


def build_vae(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """The VAE of ``name`` with random weights."""
    model, config = _require_model(name), vae_config(name, size)
    cls = AutoencoderKLQwenImage if model == "qwen-image" else AutoencoderKL
    torch.manual_seed(seed)
    with _constructing_on(device, _as_dtype(dtype)):
        vae = cls(**config)
    return vae.eval()


def build_text_encoder(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizer: Qwen2Tokenizer | None = None,
) -> torch.nn.Module:
    """The text encoder of ``name`` with random weights (Qwen2.5-VL or Qwen3)."""
    model, config = _require_model(name), text_encoder_config(name, size, tokenizer)
    cls = Qwen2_5_VLForConditionalGeneration if model == "qwen-image" else Qwen3Model
    torch.manual_seed(seed)
    with _constructing_on(device, _as_dtype(dtype)):
        text_encoder = cls(config)
    return text_encoder.eval()


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
    tok = build_tokenizer()
    kwargs = dict(size=size, device=device, dtype=dtype, seed=seed)
    components = dict(
        transformer=build_transformer(model, **kwargs),
        vae=build_vae(model, **kwargs),
        text_encoder=build_text_encoder(model, tokenizer=tok, **kwargs),
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config(model)),
        tokenizer=tok,
    )
    cls = QwenImagePipeline if model == "qwen-image" else ZImagePipeline
    pipe = cls(**components)
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

    ``name`` is an embedded model ("z-image", "qwen-image" or an alias such as "zimage",
    "qwen_image"), built offline with random weights at ``size`` ("tiny" or "full") and seeded
    with ``seed``; or a local pipeline folder or hub id, loaded with ``from_pretrained`` (``size``
    and ``seed`` do not apply). The pipeline is in eval mode on ``device`` in ``dtype``.

    An embedded model whose weights do not fit ``device``'s free memory raises
    :class:`pipelines.limits.LimitError` (a ValueError) before anything is allocated.
    """
    _check_size(size)
    dtype = _as_dtype(dtype)
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
