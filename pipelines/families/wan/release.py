"""Wan2.1 text-to-video, 14B and 1.3B: a DiT over 1x2x2 patches of a causal video VAE's latents, with
a UMT5-XXL text encoder. The two differ in the transformer's widths and depths and in the
scheduler's shift; their tiny sizes are the same model."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from ...construction import init_defaults
from ...releases.encoders import TINY_T5, UMT5_XXL
from ...releases.spec import TINY_TEXT_HIDDEN, Part, Release

__all__ = ["RELEASES", "SCHEDULER", "WAN_1_3B", "WAN_14B"]

# Wan2.1-T2V-14B (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json): 40 layers, 40 heads
# x 128 = 5120 wide, FFN 13824, 1x2x2 patches of the 16-channel video latents, UMT5-XXL text.
_TRANSFORMER_14B: dict[str, Any] = dict(
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
_TRANSFORMER_1_3B: dict[str, Any] = {**_TRANSFORMER_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
# What the tiny size changes in either.
_TINY_TRANSFORMER: dict[str, Any] = dict(
    num_attention_heads=2,
    attention_head_dim=16,  # Wan's RoPE splits it 8 (frames) + 4 + 4 (rows, columns)
    text_dim=TINY_TEXT_HIDDEN,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
)

# vae/config.json (both sizes): the causal 3D VAE, 4x in time and 8x in space (three spatial
# downsamples, the last two also temporal). latents_mean / latents_std are diffusers' defaults of
# AutoencoderKLWan, which are Wan2.1's.
_VAE: dict[str, Any] = {
    **init_defaults(AutoencoderKLWan),
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],  # sic: diffusers' spelling
}

# scheduler/scheduler_config.json beyond diffusers' defaults: UniPC on flow-matching sigmas. flow_shift: 5.0 for the 14B (the
# sample_shift of Wan's generate.py for text-to-video), 3.0 for the 1.3B (diffusers' Wan docs: 3.0
# for 480p, 5.0 for 720p). It only spaces the timesteps; no shape depends on it.
SCHEDULER: dict[str, Any] = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)

_COMMON: dict[str, Any] = dict(
    vae=Part(AutoencoderKLWan, {"full": _VAE, "tiny": {**_VAE, "base_dim": 16, "num_res_blocks": 1}}),
    text_encoders={
        "text_encoder": Part(
            UMT5EncoderModel,
            {"full": UMT5_XXL, "tiny": {**UMT5_XXL, **TINY_T5}},
            config_class=UMT5Config,
            tokenizer="t5",
        ),
    },
    scheduler_class=UniPCMultistepScheduler,
)

WAN_14B = Release(
    name="wan",
    transformer=Part(
        WanTransformer3DModel, {"full": _TRANSFORMER_14B, "tiny": {**_TRANSFORMER_14B, **_TINY_TRANSFORMER}}
    ),
    scheduler=SCHEDULER,
    **_COMMON,
)
WAN_1_3B = Release(
    name="wan-1.3b",
    transformer=Part(
        WanTransformer3DModel, {"full": _TRANSFORMER_1_3B, "tiny": {**_TRANSFORMER_1_3B, **_TINY_TRANSFORMER}}
    ),
    scheduler={**SCHEDULER, "flow_shift": 3.0},
    **_COMMON,
)

# The family's built-in models (models.py names them and their pipelines).
RELEASES = (WAN_14B, WAN_1_3B)
