"""What the zoo knows of one pipeline family: its classes, configs, geometry and inputs, as data."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["SIZES", "Embedding", "Family", "Geometry", "check_size"]

SIZES: tuple[str, ...] = ("tiny", "full")


def check_size(size: str) -> str:
    """``size`` if it is one of :data:`SIZES`; ValueError naming it otherwise."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(map(repr, SIZES))}, got {size!r}")
    return size


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where a family is usually run: its pixels and, for video, frames."""

    height: int
    width: int
    frames: int | None = None

    def as_kwargs(self) -> dict[str, int]:
        """The pipeline-call keywords of this geometry (``num_frames`` only for video)."""
        out = {"height": self.height, "width": self.width}
        if self.frames is not None:
            out["num_frames"] = self.frames
        return out


@dataclasses.dataclass(frozen=True)
class Embedding:
    """One tensor the pipeline's own text encoders would hand the denoising loop.

    ``kind`` is ``"embed"`` (random normal, in the pipeline's dtype) or a mask: ``"mask_int"``
    (int64), ``"mask_bool"``, ``"mask_float"`` (in the pipeline's dtype) mark a random number of
    leading tokens per row as real, the rest as padding, as a tokenizer padding to a fixed length
    would; ``"mask_ones"`` (int64) marks every token real, as encoders that cut the embeddings to
    the prompt's own length produce for one prompt.
    """

    shape: tuple[int, ...]
    kind: str = "embed"


@dataclasses.dataclass(frozen=True)
class Family:
    """One diffusers pipeline at its released configuration, and a tiny one of the same structure.

    Per size (``"tiny"``, ``"full"``): the denoiser's and the VAE's constructor kwargs, the usual
    geometry and the shapes of the text embeddings. The scheduler is the same at both sizes.
    ``guidance`` are the call keywords that set guidance (``guidance_scale`` or
    ``true_cfg_scale``); ``cfg`` says whether they make each step run two guidance branches.
    ``extras`` are further call keywords (``max_sequence_length`` and the like); ``image`` names
    an input image keyword (edit pipelines), made of random pixels at the call's geometry.
    The denoiser's and the VAE's classes, and the scheduler's unless ``scheduler_class`` names
    another (the release's, where the pipeline's signature names a base or another scheduler), are
    those the pipeline's constructor annotates its components with.
    ``components`` are constructor arguments built from a diffusers class (name, kwargs), such as
    a guider; ``pipeline_kwargs`` plain constructor arguments. Every other constructor argument
    (the text encoders, tokenizers, processors, image encoders) is None. ``attributes`` are set on
    the built pipeline, per size.
    """

    name: str
    pipeline: str
    released: str
    denoiser_configs: Mapping[str, Mapping[str, Any]]
    vae_configs: Mapping[str, Mapping[str, Any]]
    scheduler: Mapping[str, Any]
    geometry: Mapping[str, Geometry]
    embeddings: Mapping[str, Mapping[str, Embedding]]
    steps: int
    guidance: Mapping[str, float]
    cfg: bool
    extras: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    image: str | None = None
    components: Mapping[str, tuple[str, Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    pipeline_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    attributes: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    scheduler_class: str = ""

    def __post_init__(self) -> None:
        if not self.scheduler_class:
            object.__setattr__(self, "scheduler_class", self._class_of("scheduler"))

    @property
    def denoiser(self) -> str:
        """The pipeline's denoiser component: ``"unet"`` where its call is built on one, else ``"transformer"``."""
        return "unet" if "unet" in _init_parameters(self.pipeline) else "transformer"

    @property
    def denoiser_class(self) -> str:
        """The class the pipeline's constructor names for its denoiser."""
        return self._class_of(self.denoiser)

    @property
    def vae_class(self) -> str:
        """The class the pipeline's constructor names for its VAE."""
        return self._class_of("vae")

    def _class_of(self, component: str) -> str:
        """The diffusers class ``pipeline``'s ``__init__`` annotates ``component`` with (its
        ``Optional`` unwrapped); ValueError where it names none."""
        annotation = _init_parameters(self.pipeline)[component].annotation
        import diffusers

        if isinstance(annotation, str):
            annotation = getattr(diffusers, annotation, None)
        for cls in (annotation, *typing.get_args(annotation)):
            if isinstance(cls, type) and cls is not type(None) and hasattr(diffusers, cls.__name__):
                return cls.__name__
        raise ValueError(
            f"{self.name}: {self.pipeline} names no diffusers class for {component}; give it in the Family"
        )

    def denoiser_config(self, size: str) -> dict[str, Any]:
        """The denoiser's constructor kwargs at ``size`` (a copy: callers may edit it)."""
        return copy.deepcopy(dict(self.denoiser_configs[check_size(size)]))

    def vae_config(self, size: str) -> dict[str, Any]:
        """The VAE's constructor kwargs at ``size`` (a copy)."""
        return copy.deepcopy(dict(self.vae_configs[check_size(size)]))

    def scheduler_config(self) -> dict[str, Any]:
        """The scheduler's constructor kwargs (a copy)."""
        return copy.deepcopy(dict(self.scheduler))


@functools.cache
def _init_parameters(pipeline: str) -> Mapping[str, inspect.Parameter]:
    """The parameters of diffusers' ``pipeline`` class's constructor."""
    import diffusers

    return inspect.signature(getattr(diffusers, pipeline).__init__).parameters
