"""What a family's ``models.py`` states, as torch-free records: :class:`ModelRecord` (one built-in
model) and :class:`Family` (the folder's record, with the defaults its models run at)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Family", "ModelRecord"]


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """A built-in model (built offline with random weights by :func:`pipelines.builders.build_pipeline`).

    ``name`` and ``aliases`` are lower case (names are read stripped and lower-cased); ``pipeline``
    is the diffusers pipeline class it builds, by name. ``frames_per_latent``: a video model's VAE
    packs this many frames into each latent frame after the first (so it makes
    ``frames_per_latent * k + 1`` frames); None for a model that makes images. ``video_runs``: a
    video model's run that names no resolution or frame count, by size (``"tiny"``, ``"full"``):
    ``((width, height), frames)``; an image model's is the front end's default resolution.
    ``generation``: how its pipeline is run where that differs from its family's (two pipelines of
    one family taking different arguments: FLUX.2 klein's guidance scale, which klein KV's call does
    not take; Z-Image Omni, undistilled, beside the Turbo its family's recipe speaks for); None: its family's.
    """

    name: str
    pipeline: str
    aliases: tuple[str, ...] = ()
    frames_per_latent: int | None = None
    video_runs: Mapping[str, tuple[tuple[int, int], int]] = dataclasses.field(default_factory=dict)
    generation: Mapping[str, Any] | None = None

    @property
    def video(self) -> bool:
        """Whether its pipeline makes videos (its call takes ``num_frames``)."""
        return self.frames_per_latent is not None


@dataclasses.dataclass(frozen=True)
class Family:
    """One family folder's record (its ``models.py`` names it ``FAMILY``).

    ``order`` places its models in lists (help texts, error messages): lower first. ``models``
    are its built-in models (none for a family that runs only from a hub id or a local folder).
    ``generation`` is how its pipelines are usually run, as keyword arguments of
    ``accel.GenerationDefaults`` (steps, guidance, ...): its recipe returns them, and where the
    generic recipe serves the family, front ends look them up by pipeline class. None: the
    pipeline's own defaults.
    """

    order: int
    models: tuple[ModelRecord, ...] = ()
    generation: Mapping[str, Any] | None = None
