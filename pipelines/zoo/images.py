"""Text-to-image (and image-edit) families at their released denoiser configs.

Each full config is the ``transformer/config.json`` (or ``unet/``) of the named hub repository,
written as constructor kwargs; where diffusers' constructor defaults already are that release
they are read from the class (``builders.init_defaults``) rather than repeated. FLUX.1-dev and
Qwen-Image come from :mod:`pipelines.builders`. Their parameter counts are checked against the
released models' in the tests. The tiny configs keep every structural choice (block types, patch
sizes, latent channels and VAE scale factors, text streams) at a few layers and narrow widths.

Embedding shapes are those the pipeline's own text encoders produce at the release's usual text
length: for example FLUX.1's T5-XXL ``(1, 512, 4096)`` and pooled CLIP-L ``(1, 768)``.
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    AutoencoderKLFlux2,
    ChromaTransformer2DModel,
    Flux2Transformer2DModel,
    Lumina2Transformer2DModel,
    SanaTransformer2DModel,
)

from .. import builders
from .spec import Embedding, Family, Geometry

__all__ = ["IMAGE_FAMILIES"]

# The width of every tiny text stream: the tiny denoisers read text this wide.
TINY_TEXT = 32
TINY_TEXT_LEN = 16
TINY_GEOMETRY = Geometry(height=64, width=64)
FULL_GEOMETRY = Geometry(height=1024, width=1024)
GEOMETRY = {"tiny": TINY_GEOMETRY, "full": FULL_GEOMETRY}


def _e(*shape: int) -> Embedding:
    return Embedding(tuple(shape))


def _mask(length: int, kind: str = "mask_int") -> Embedding:
    return Embedding((1, length), kind)


def _text_pair(length: int, width: int, mask: str | None = None) -> dict[str, Embedding]:
    """prompt and negative prompt embeddings (and masks) of one text stream."""
    out = {"prompt_embeds": _e(1, length, width), "negative_prompt_embeds": _e(1, length, width)}
    if mask is not None:
        out["prompt_attention_mask"] = _mask(length, mask)
        out["negative_prompt_attention_mask"] = _mask(length, mask)
    return out


# The FLUX.1 autoencoder (16 latent channels, no quant convs), which SD3.5, Chroma, HiDream and
# Lumina 2 ship too; only SD3.5's scaling and shift differ.
_FLUX_VAE = {size: builders.vae_config("flux", size) for size in ("tiny", "full")}
_SD3_VAE = {size: {**_FLUX_VAE[size], "scaling_factor": 1.5305, "shift_factor": 0.0609} for size in _FLUX_VAE}

# The SDXL autoencoder (4 latent channels, with quant convs), which PixArt-Sigma ships too.
_SDXL_VAE_FULL: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.13025,
    force_upcast=True,
)
_SDXL_VAE = {
    "full": _SDXL_VAE_FULL,
    "tiny": {**_SDXL_VAE_FULL, "block_out_channels": [16, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8},
}

# FLUX.1-dev's scheduler: the shift grows with the image's token count. Chroma ships the same.
_FLUX_SCHEDULER = builders.scheduler_config("flux")
# Sana's and PixArt-Sigma's released DPM-Solver++ schedulers share these; Sana's predicts flow.
_DPM_SOLVER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    beta_start=0.0001,
    beta_end=0.02,
    beta_schedule="linear",
    algorithm_type="dpmsolver++",
    solver_order=2,
    solver_type="midpoint",
    lower_order_final=True,
    timestep_spacing="linspace",
)
# Sana's and PixArt-Sigma's calls beside their embeddings: T5 text of 300 tokens, and no
# resolution binning at the tiny size (binning snaps sizes to the release's aspect-ratio table,
# which has 1024x1024 but not the tiny geometry).
_BINNED_T5_EXTRAS = {
    "full": {"negative_prompt": None, "max_sequence_length": 300},
    "tiny": {"negative_prompt": None, "max_sequence_length": TINY_TEXT_LEN, "use_resolution_binning": False},
}


def _flux() -> Family:
    return Family(
        name="flux",
        pipeline="FluxPipeline",
        released="black-forest-labs/FLUX.1-dev",
        denoiser="transformer",
        denoiser_class="FluxTransformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={s: builders.transformer_config("flux", s) for s in ("tiny", "full")},
        vae_configs=_FLUX_VAE,
        scheduler=_FLUX_SCHEDULER,
        geometry=GEOMETRY,
        embeddings={
            "full": {"prompt_embeds": _e(1, 512, 4096), "pooled_prompt_embeds": _e(1, 768)},
            "tiny": {"prompt_embeds": _e(1, TINY_TEXT_LEN, TINY_TEXT), "pooled_prompt_embeds": _e(1, TINY_TEXT)},
        },
        extras={"full": {"max_sequence_length": 512}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=28,
        guidance={"guidance_scale": 3.5},  # distilled guidance: an input of one call, not two branches
        cfg=False,
    )


def _flux2() -> Family:
    # FLUX.2-dev: 8 double-stream and 48 single-stream blocks, 48 heads x 128 = 6144 wide, the
    # text three Mistral-Small-3.1 hidden layers stacked (3 x 5120 = 15360). diffusers' defaults.
    full = builders.init_defaults(Flux2Transformer2DModel)
    tiny = {
        **full,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
        "num_attention_heads": 2,
        "joint_attention_dim": 3 * TINY_TEXT,
        "timestep_guidance_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4),
    }
    vae_full = builders.init_defaults(AutoencoderKLFlux2)  # 32 latent channels, 2x2 patchified
    vae_tiny = {**vae_full, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 8}
    return Family(
        name="flux2",
        pipeline="Flux2Pipeline",
        released="black-forest-labs/FLUX.2-dev",
        denoiser="transformer",
        denoiser_class="Flux2Transformer2DModel",
        vae_class="AutoencoderKLFlux2",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler=dict(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            time_shift_type="exponential",
        ),
        geometry=GEOMETRY,
        embeddings={
            "full": {"prompt_embeds": _e(1, 512, 15360)},
            "tiny": {"prompt_embeds": _e(1, TINY_TEXT_LEN, 3 * TINY_TEXT)},
        },
        extras={"full": {"max_sequence_length": 512}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=50,
        guidance={"guidance_scale": 4.0},  # distilled guidance
        cfg=False,
    )


def _sd3() -> Family:
    # Stable Diffusion 3.5 Large: 38 MMDiT blocks, 38 heads x 64 = 2432 wide, QK RMS norm; text
    # is CLIP-L + CLIP-G (77 tokens, padded to 4096) followed by 256 T5-XXL tokens.
    full: dict[str, Any] = dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=38,
        attention_head_dim=64,
        num_attention_heads=38,
        joint_attention_dim=4096,
        caption_projection_dim=2432,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=192,
        dual_attention_layers=(),
        qk_norm="rms_norm",
    )
    tiny = {
        **full,
        "sample_size": 8,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": TINY_TEXT,
        "caption_projection_dim": 32,
        "pooled_projection_dim": TINY_TEXT,
        "pos_embed_max_size": 16,
    }
    pooled = {"pooled_prompt_embeds", "negative_pooled_prompt_embeds"}
    return Family(
        name="sd3",
        pipeline="StableDiffusion3Pipeline",
        released="stabilityai/stable-diffusion-3.5-large",
        denoiser="transformer",
        denoiser_class="SD3Transformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_SD3_VAE,
        scheduler=dict(num_train_timesteps=1000, shift=3.0),
        geometry=GEOMETRY,
        embeddings={
            "full": {**_text_pair(77 + 256, 4096), **{k: _e(1, 2048) for k in pooled}},
            "tiny": {**_text_pair(TINY_TEXT_LEN, TINY_TEXT), **{k: _e(1, TINY_TEXT) for k in pooled}},
        },
        steps=28,
        guidance={"guidance_scale": 3.5},
        cfg=True,
    )


def _sdxl() -> Family:
    # SDXL base 1.0: three levels (320, 640, 1280), 1 / 2 / 10 transformer layers per block, the
    # two CLIP text encoders concatenated (768 + 1280 = 2048), CLIP-G's pooled output and six
    # size/crop numbers as added conditions (1280 + 6 x 256 = 2816).
    full: dict[str, Any] = dict(
        sample_size=128,
        in_channels=4,
        out_channels=4,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        block_out_channels=[320, 640, 1280],
        layers_per_block=2,
        attention_head_dim=[5, 10, 20],
        cross_attention_dim=2048,
        transformer_layers_per_block=[1, 2, 10],
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
        norm_num_groups=32,
    )
    tiny = {
        **full,
        "sample_size": 8,
        "block_out_channels": [32, 32, 64],
        "layers_per_block": 1,
        "attention_head_dim": [2, 2, 4],
        "cross_attention_dim": 2 * TINY_TEXT,
        "transformer_layers_per_block": [1, 1, 2],
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": TINY_TEXT + 6 * 8,
        "norm_num_groups": 8,
    }
    pooled = {"pooled_prompt_embeds", "negative_pooled_prompt_embeds"}
    return Family(
        name="sdxl",
        pipeline="StableDiffusionXLPipeline",
        released="stabilityai/stable-diffusion-xl-base-1.0",
        denoiser="unet",
        denoiser_class="UNet2DConditionModel",
        vae_class="AutoencoderKL",
        scheduler_class="EulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_SDXL_VAE,
        scheduler=dict(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
            interpolation_type="linear",
            prediction_type="epsilon",
            use_karras_sigmas=False,
        ),
        geometry=GEOMETRY,
        embeddings={
            "full": {**_text_pair(77, 2048), **{k: _e(1, 1280) for k in pooled}},
            "tiny": {**_text_pair(77, 2 * TINY_TEXT), **{k: _e(1, TINY_TEXT) for k in pooled}},
        },
        steps=50,
        guidance={"guidance_scale": 5.0},
        cfg=True,
        # No invisible watermark: it needs a package of its own and changes only decoded images.
        pipeline_kwargs={"add_watermarker": False},
    )


def _sana() -> Family:
    # Sana 1600M at 1024px: 20 linear-attention blocks, 70 heads x 32 = 2240 wide, Gemma-2-2B
    # text (2304 wide, 300 tokens), the 32x deep-compression autoencoder (32 latent channels).
    full = builders.init_defaults(SanaTransformer2DModel)
    tiny = {
        **full,
        "in_channels": 8,
        "out_channels": 8,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "num_layers": 2,
        "num_cross_attention_heads": 2,
        "cross_attention_head_dim": 16,
        "cross_attention_dim": 32,
        "caption_channels": TINY_TEXT,
        "sample_size": 2,
    }
    vae_full: dict[str, Any] = dict(
        in_channels=3,
        latent_channels=32,
        attention_head_dim=32,
        encoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
        decoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
        encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
        decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
        encoder_layers_per_block=[2, 2, 2, 3, 3, 3],
        decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
        encoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
        decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        decoder_norm_types=["batch_norm"] * 3 + ["rms_norm"] * 3,
        decoder_act_fns=["relu"] * 3 + ["silu"] * 3,
        scaling_factor=0.41407,
    )
    vae_tiny = {
        **vae_full,
        "latent_channels": 8,
        "attention_head_dim": 8,
        "encoder_block_out_channels": [8, 8, 16, 16, 16, 16],
        "decoder_block_out_channels": [8, 8, 16, 16, 16, 16],
        "encoder_layers_per_block": [1] * 6,
        "decoder_layers_per_block": [1] * 6,
    }
    return Family(
        name="sana",
        pipeline="SanaPipeline",
        released="Efficient-Large-Model/Sana_1600M_1024px_diffusers",
        denoiser="transformer",
        denoiser_class="SanaTransformer2DModel",
        vae_class="AutoencoderDC",
        scheduler_class="DPMSolverMultistepScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler={
            **_DPM_SOLVER,
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": 3.0,
            "final_sigmas_type": "zero",
        },
        geometry=GEOMETRY,
        embeddings={
            "full": _text_pair(300, 2304, "mask_int"),
            "tiny": _text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
        },
        extras=_BINNED_T5_EXTRAS,
        steps=20,
        guidance={"guidance_scale": 4.5},
        cfg=True,
    )


def _pixart_sigma() -> Family:
    # PixArt-Sigma XL/2 at 1024px: 28 blocks, 16 heads x 72 = 1152 wide, T5-XXL text (300 tokens),
    # a learned variance (8 = 2 x 4 output channels), the SDXL autoencoder.
    full: dict[str, Any] = dict(
        num_attention_heads=16,
        attention_head_dim=72,
        in_channels=4,
        out_channels=8,
        num_layers=28,
        cross_attention_dim=1152,
        attention_bias=True,
        sample_size=128,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        interpolation_scale=2,
        use_additional_conditions=False,
        caption_channels=4096,
    )
    tiny = {
        **full,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "num_layers": 2,
        "cross_attention_dim": 32,
        "sample_size": 8,
        "interpolation_scale": 1,
        "caption_channels": TINY_TEXT,
    }
    return Family(
        name="pixart-sigma",
        pipeline="PixArtSigmaPipeline",
        released="PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
        denoiser="transformer",
        denoiser_class="PixArtTransformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="DPMSolverMultistepScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_SDXL_VAE,
        scheduler={**_DPM_SOLVER, "prediction_type": "epsilon"},
        geometry=GEOMETRY,
        embeddings={
            "full": _text_pair(300, 4096, "mask_int"),
            "tiny": _text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
        },
        extras=_BINNED_T5_EXTRAS,
        steps=20,
        guidance={"guidance_scale": 4.5},
        cfg=True,
    )


def _chroma() -> Family:
    # Chroma1-HD: FLUX.1-schnell's 19 + 38 blocks with the modulation computed by one small
    # network (the "approximator") instead of per block, T5-XXL text only (512 tokens).
    full = builders.init_defaults(ChromaTransformer2DModel)
    tiny = {
        **full,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
        "num_attention_heads": 2,
        "joint_attention_dim": TINY_TEXT,
        "axes_dims_rope": (4, 6, 6),
        "approximator_num_channels": 16,
        "approximator_hidden_dim": 32,
        "approximator_layers": 1,
    }
    return Family(
        name="chroma",
        pipeline="ChromaPipeline",
        released="lodestones/Chroma1-HD",
        denoiser="transformer",
        denoiser_class="ChromaTransformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_FLUX_VAE,
        scheduler=_FLUX_SCHEDULER,
        geometry=GEOMETRY,
        # The pipeline's own T5 step hands the mask on in the embeddings' dtype.
        embeddings={
            "full": _text_pair(512, 4096, "mask_float"),
            "tiny": _text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_float"),
        },
        extras={"full": {"max_sequence_length": 512}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=40,
        guidance={"guidance_scale": 5.0},
        cfg=True,
    )


def _cogview4() -> Family:
    # CogView4-6B: 28 blocks, 32 heads x 128 = 4096 wide, GLM-4-9B text (4096 wide; the prompt
    # padded to a multiple of 16, so a short negative prompt is 16 tokens).
    full: dict[str, Any] = dict(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=28,
        attention_head_dim=128,
        num_attention_heads=32,
        text_embed_dim=4096,
        time_embed_dim=512,
        condition_dim=256,
        pos_embed_max_size=128,
        sample_size=128,
        rope_axes_dim=(256, 256),
    )
    tiny = {
        **full,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "text_embed_dim": TINY_TEXT,
        "time_embed_dim": 16,
        "condition_dim": 8,
        "pos_embed_max_size": 16,
        "sample_size": 8,
        "rope_axes_dim": (16, 16),
    }
    vae_full: dict[str, Any] = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 512, 1024, 1024],
        layers_per_block=3,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=1024,
        scaling_factor=1.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae_tiny = {**vae_full, "block_out_channels": [16, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8}
    return Family(
        name="cogview4",
        pipeline="CogView4Pipeline",
        released="THUDM/CogView4-6B",
        denoiser="transformer",
        denoiser_class="CogView4Transformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs={"full": vae_full, "tiny": vae_tiny},
        scheduler=dict(
            num_train_timesteps=1000,
            base_image_seq_len=256,
            base_shift=0.25,
            max_shift=0.75,
            shift=1.0,
            use_dynamic_shifting=True,
            time_shift_type="linear",
        ),
        geometry=GEOMETRY,
        embeddings={
            "full": {"prompt_embeds": _e(1, 128, 4096), "negative_prompt_embeds": _e(1, 16, 4096)},
            "tiny": {"prompt_embeds": _e(1, TINY_TEXT_LEN, TINY_TEXT), "negative_prompt_embeds": _e(1, 16, TINY_TEXT)},
        },
        steps=50,
        guidance={"guidance_scale": 5.0},
        cfg=True,
    )


def _hidream() -> Family:
    # HiDream-I1-Full: 16 double-stream and 32 single-stream blocks, 20 heads x 128 = 2560 wide,
    # a mixture of 4 experts (2 active) in every feed-forward; text: T5-XXL, and every hidden layer
    # of Llama-3.1-8B (32 x 4096) of which each block reads one; pooled CLIP-L + CLIP-G (2048).
    full: dict[str, Any] = dict(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=16,
        num_single_layers=32,
        attention_head_dim=128,
        num_attention_heads=20,
        caption_channels=[4096, 4096],
        text_emb_dim=2048,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(64, 32, 32),
        max_resolution=(128, 128),
        llama_layers=[*range(32), *[31] * 16],
    )
    tiny = {
        **full,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,  # must equal sum(axes_dims_rope)
        "num_attention_heads": 2,
        "caption_channels": [TINY_TEXT, TINY_TEXT],
        "text_emb_dim": TINY_TEXT,
        "axes_dims_rope": (8, 4, 4),
        "llama_layers": [0, 1],
    }

    def streams(length: int, width: int, llama_layers: int, pooled: int) -> dict[str, Embedding]:
        return {
            "prompt_embeds_t5": _e(1, length, width),
            "negative_prompt_embeds_t5": _e(1, length, width),
            "prompt_embeds_llama3": _e(llama_layers, 1, length, width),
            "negative_prompt_embeds_llama3": _e(llama_layers, 1, length, width),
            "pooled_prompt_embeds": _e(1, pooled),
            "negative_pooled_prompt_embeds": _e(1, pooled),
        }

    return Family(
        name="hidream",
        pipeline="HiDreamImagePipeline",
        released="HiDream-ai/HiDream-I1-Full",
        denoiser="transformer",
        denoiser_class="HiDreamImageTransformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="UniPCMultistepScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_FLUX_VAE,
        scheduler=dict(
            num_train_timesteps=1000,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=3.0,
            solver_order=2,
        ),
        geometry=GEOMETRY,
        embeddings={
            "full": streams(128, 4096, 32, 2048),
            "tiny": streams(TINY_TEXT_LEN, TINY_TEXT, 2, TINY_TEXT),
        },
        extras={"full": {"max_sequence_length": 128}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=50,
        guidance={"guidance_scale": 5.0},
        cfg=True,
        # The pipeline rescales every request to the area of default_sample_size latents (1024x1024
        # pixels); the tiny size keeps its own geometry.
        attributes={"tiny": {"default_sample_size": TINY_GEOMETRY.height // 8}},
    )


def _lumina2() -> Family:
    # Lumina-Image-2.0: 26 blocks + 2 + 2 refiners, 24 heads (8 KV) x 96 = 2304 wide, Gemma-2-2B
    # text (2304 wide, 256 tokens). diffusers' defaults but for the text width.
    full = {**builders.init_defaults(Lumina2Transformer2DModel), "cap_feat_dim": 2304}
    tiny = {
        **full,
        "sample_size": 8,
        "hidden_size": 32,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "multiple_of": 16,
        "axes_dim_rope": (4, 6, 6),  # must sum to the head dim (32 / 2)
        "axes_lens": (64, 64, 64),
        "cap_feat_dim": TINY_TEXT,
    }
    return Family(
        name="lumina2",
        pipeline="Lumina2Pipeline",
        released="Alpha-VLLM/Lumina-Image-2.0",
        denoiser="transformer",
        denoiser_class="Lumina2Transformer2DModel",
        vae_class="AutoencoderKL",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={"full": full, "tiny": tiny},
        vae_configs=_FLUX_VAE,
        scheduler=dict(num_train_timesteps=1000, shift=6.0),
        geometry=GEOMETRY,
        embeddings={
            "full": _text_pair(256, 2304, "mask_int"),
            "tiny": _text_pair(TINY_TEXT_LEN, TINY_TEXT, "mask_int"),
        },
        extras={"full": {"max_sequence_length": 256}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}},
        steps=30,
        guidance={"guidance_scale": 4.0},
        cfg=True,
    )


def _qwen_image_edit() -> Family:
    # Qwen-Image-Edit: Qwen-Image's 20B transformer and VAE; the text is Qwen2.5-VL-7B reading the
    # prompt and the input image together (the image's vision tokens make the text long). The
    # pipeline cuts the embeddings to the prompt's own length: one prompt's mask is all ones.
    def streams(length: int, width: int) -> dict[str, Embedding]:
        return {
            "prompt_embeds": _e(1, length, width),
            "prompt_embeds_mask": _mask(length, "mask_ones"),
            "negative_prompt_embeds": _e(1, length, width),
            "negative_prompt_embeds_mask": _mask(length, "mask_ones"),
        }

    return Family(
        name="qwen-image-edit",
        pipeline="QwenImageEditPipeline",
        released="Qwen/Qwen-Image-Edit",
        denoiser="transformer",
        denoiser_class="QwenImageTransformer2DModel",
        vae_class="AutoencoderKLQwenImage",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        denoiser_configs={s: builders.transformer_config("qwen-image", s) for s in ("tiny", "full")},
        vae_configs={s: builders.vae_config("qwen-image", s) for s in ("tiny", "full")},
        scheduler=builders.scheduler_config("qwen-image"),
        geometry=GEOMETRY,
        embeddings={"full": streams(1400, 3584), "tiny": streams(TINY_TEXT_LEN, TINY_TEXT)},
        steps=50,
        guidance={"true_cfg_scale": 4.0},
        cfg=True,
        image="image",
    )


IMAGE_FAMILIES: tuple[Family, ...] = (
    _flux(),
    _flux2(),
    _sd3(),
    _sdxl(),
    _sana(),
    _pixart_sigma(),
    _chroma(),
    _cogview4(),
    _hidream(),
    _lumina2(),
    _qwen_image_edit(),
)
