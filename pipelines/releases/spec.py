"""What the builders know of one built-in model: its classes and its released configs, as data."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TINY_TEXT_HIDDEN", "TOKENIZERS", "Part", "Release"]

# Tiny text encoders are this wide; the tiny transformers' text input width must match.
TINY_TEXT_HIDDEN = 32
# The offline tokenizers (pipelines.tokenizer, pipelines.tokenizers_t5_clip) a text encoder reads.
TOKENIZERS = ("qwen", "clip", "t5")


@dataclasses.dataclass(frozen=True)
class Part:
    """One component with weights: its class and its constructor arguments at each size.

    ``configs`` maps ``"tiny"`` and ``"full"`` to complete keyword arguments. A text encoder also
    names its transformers ``config_class`` (built from those arguments) and the offline
    ``tokenizer`` it reads (one of :data:`TOKENIZERS`): the tokenizer adds the special token ids
    and, at the tiny size, the vocabulary size (its length rounded up to a multiple of 64).
    """

    cls: type
    configs: Mapping[str, Mapping[str, Any]]
    config_class: type | None = None
    tokenizer: str | None = None

    def config(self, size: str) -> dict[str, Any]:
        """The arguments at ``size`` (a deep copy: callers may edit it)."""
        return copy.deepcopy(dict(self.configs[size]))


@dataclasses.dataclass(frozen=True)
class Release:
    """A built-in model at its released configuration, and a tiny one of the same structure.

    ``name`` is the model's in the catalog (:mod:`pipelines.families.catalog`), which also holds
    its aliases and pipeline class. ``text_encoders`` are by pipeline component name
    (``text_encoder``, ``text_encoder_2``); each one's tokenizer is the pipeline's ``tokenizer``
    (``tokenizer_2``). ``redrawn`` are transformer parameters drawn from a normal distribution
    after construction, where their zero init would hide what they do. ``pipeline_kwargs`` are
    the pipeline constructor's other arguments the release sets (its ``model_index.json``: FLUX.2
    klein's ``is_distilled``). ``processor``: for a pipeline that reads its prompt (and images)
    through a processor instead of a tokenizer (Qwen-Image 2.1's Qwen3-VL processor),
    ``processor(tokenizer, size)`` builds it over its text encoder's tokenizer; the pipeline then
    gets ``processor=`` in place of ``tokenizer=``.

    Pipelines that read images take more: ``image_encoders`` are further components with weights
    (a vision tower), by pipeline component name, built from their ``config_class`` as text
    encoders are (``cls(config)``); ``image_processors`` are components without weights (an image
    processor beside the tokenizer), by name, each its class and constructor arguments; ``absent``
    names components the offline build leaves None (a processor that needs a package the install
    may lack).
    """

    name: str
    transformer: Part
    vae: Part
    text_encoders: Mapping[str, Part]
    scheduler_class: type
    scheduler: Mapping[str, Any]
    redrawn: tuple[str, ...] = ()
    pipeline_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    processor: Callable[[Any, str], Any] | None = None
    image_encoders: Mapping[str, Part] = dataclasses.field(default_factory=dict)
    image_processors: Mapping[str, tuple[type, Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    absent: tuple[str, ...] = ()
