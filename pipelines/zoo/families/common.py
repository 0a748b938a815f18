"""What several zoo families share: the tiny text streams and geometries, the embedding shapes'
helpers, the FLUX.1 and SDXL autoencoders and the DPM-Solver++ scheduler settings."""

from __future__ import annotations

from typing import Any

from ...releases.configs import scheduler_config, vae_config
from ..spec import Embedding, Geometry

__all__ = [
    "BINNED_T5_EXTRAS",
    "DPM_SOLVER",
    "FLUX_SCHEDULER",
    "FLUX_VAE",
    "GEOMETRY",
    "SD3_VAE",
    "SDXL_VAE",
    "TINY_CLIP",
    "TINY_GEOMETRY",
    "TINY_TEXT",
    "TINY_TEXT_LEN",
    "e",
    "mask",
    "text_length",
    "text_pair",
]

# The width of every tiny text stream: the tiny denoisers read text this wide.
TINY_TEXT = 32
TINY_TEXT_LEN = 16
TINY_GEOMETRY = Geometry(height=64, width=64)
GEOMETRY = {"tiny": TINY_GEOMETRY, "full": Geometry(height=1024, width=1024)}
# Wan and HunyuanVideo compress time 4x (4k + 1 frames); LTX-Video 8x (8k + 1).
TINY_CLIP = Geometry(height=64, width=64, frames=5)


def e(*shape: int) -> Embedding:
    """A random embedding of ``shape``."""
    return Embedding(tuple(shape))


def mask(length: int, kind: str = "mask_int") -> Embedding:
    """A one-row attention mask over ``length`` tokens (see :class:`pipelines.zoo.spec.Embedding`)."""
    return Embedding((1, length), kind)


def text_pair(length: int, width: int, mask_kind: str | None = None) -> dict[str, Embedding]:
    """prompt and negative prompt embeddings (and masks) of one text stream."""
    out = {"prompt_embeds": e(1, length, width), "negative_prompt_embeds": e(1, length, width)}
    if mask_kind is not None:
        out["prompt_attention_mask"] = mask(length, mask_kind)
        out["negative_prompt_attention_mask"] = mask(length, mask_kind)
    return out


def text_length(full: int) -> dict[str, dict[str, Any]]:
    """The ``max_sequence_length`` call keyword: ``full`` tokens at the full size, the tiny text's
    length at the tiny size."""
    return {"full": {"max_sequence_length": full}, "tiny": {"max_sequence_length": TINY_TEXT_LEN}}


# The FLUX.1 autoencoder (16 latent channels, no quant convs), which SD3.5, Chroma, HiDream and
# Lumina 2 ship too; only SD3.5's scaling and shift differ.
FLUX_VAE = {size: vae_config("flux", size) for size in ("tiny", "full")}
SD3_VAE = {size: {**FLUX_VAE[size], "scaling_factor": 1.5305, "shift_factor": 0.0609} for size in FLUX_VAE}

# The SDXL autoencoder, which PixArt-Sigma ships too: the FLUX.1 one's blocks with 4 latent channels,
# quant convs and its own scaling, no shift.
_SDXL: dict[str, Any] = dict(
    latent_channels=4, scaling_factor=0.13025, shift_factor=None, use_quant_conv=True, use_post_quant_conv=True
)
SDXL_VAE = {size: {**FLUX_VAE[size], **_SDXL} for size in FLUX_VAE}

# FLUX.1-dev's scheduler: the shift grows with the image's token count. Chroma ships the same.
FLUX_SCHEDULER = scheduler_config("flux")
# Sana's and PixArt-Sigma's released DPM-Solver++ schedulers share these; Sana's predicts flow.
DPM_SOLVER: dict[str, Any] = dict(
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
BINNED_T5_EXTRAS = {
    "full": {"negative_prompt": None, "max_sequence_length": 300},
    "tiny": {"negative_prompt": None, "max_sequence_length": TINY_TEXT_LEN, "use_resolution_binning": False},
}
