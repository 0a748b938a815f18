"""The built-in models as the flags are checked against them before torch is imported: each
name and alias, the pipeline class it builds, and whether it makes videos.

:mod:`pipelines.releases` holds the models themselves but imports torch and diffusers, which take
3-5 s; a flag that cannot fit a model by its name alone (``--frames`` for an image model) is
refused at once from this mirror instead. tests/pipelines/cli/test_help_claims.py keeps it equal
to the releases.
"""

from __future__ import annotations

import dataclasses

__all__ = ["KNOWN_MODELS", "KnownModel", "known_model", "video_model_names"]


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A built-in model. ``frames_per_latent``: a video model's VAE packs this many frames into
    each latent frame after the first (so it makes ``frames_per_latent * k + 1`` frames); None
    for a model that makes images."""

    name: str
    pipeline: str
    aliases: tuple[str, ...] = ()
    frames_per_latent: int | None = None

    @property
    def video(self) -> bool:
        """Whether its pipeline makes videos (its call takes ``num_frames``)."""
        return self.frames_per_latent is not None


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel("z-image", "ZImagePipeline", ("zimage", "z_image")),
    KnownModel("qwen-image", "QwenImagePipeline", ("qwenimage", "qwen_image")),
    KnownModel("flux", "FluxPipeline", ("flux.1", "flux1", "flux-dev", "flux.1-dev", "flux1-dev")),
    KnownModel("wan", "WanPipeline", ("wan2.1", "wan-14b", "wan2.1-14b", "wan2.1-t2v-14b"), frames_per_latent=4),
    KnownModel("wan-1.3b", "WanPipeline", ("wan2.1-1.3b", "wan2.1-t2v-1.3b"), frames_per_latent=4),
)

# Every spelling, lower case, as pipelines.releases.canonical_name reads a name.
_BY_ALIAS: dict[str, KnownModel] = {alias: m for m in KNOWN_MODELS for alias in (m.name, *m.aliases)}


def known_model(name: str) -> KnownModel | None:
    """The built-in model ``name`` (any of its spellings) refers to, or None."""
    return _BY_ALIAS.get(name.strip().lower())


def video_model_names() -> tuple[str, ...]:
    """The built-in models that make videos, by name."""
    return tuple(m.name for m in KNOWN_MODELS if m.video)
