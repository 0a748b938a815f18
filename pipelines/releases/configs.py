"""The built-in models' classes, their configs at each size, and their tokenizers, read from each
family's release data (``pipelines/families/<family>/release.py``, for the models the catalog
lists).

Configs are read as copies; a text encoder's config adds what only its tokenizer knows: the
special token ids, so that generation-side ids (pad, eos, image tokens) agree with what the
pipeline's tokenizer produces, and at the tiny size the vocabulary size.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedConfig, PreTrainedTokenizerBase

from ..construction import init_defaults
from ..families.catalog import ALIASES, FAMILIES, MODEL_NAMES, canonical_name, known_model, module_name
from ..families.records import ModelRecord
from ..tokenizer import build_tokenizer, special_token_ids
from ..tokenizers_t5_clip import build_clip_tokenizer, build_t5_tokenizer
from .spec import Part, Release

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

__all__ = [
    "ALIASES",
    "MODEL_NAMES",
    "RELEASES",
    "SIZES",
    "build_tokenizers",
    "canonical_name",
    "check_size",
    "components",
    "constructor",
    "full_transformer_config",
    "pipeline_class",
    "release",
    "require_model",
    "scheduler_config",
    "text_encoder_2_config",
    "text_encoder_config",
    "transformer_class",
    "transformer_config",
    "vae_config",
]

SIZES: tuple[str, ...] = ("tiny", "full")


def _read_releases() -> dict[str, Release]:
    """Every built-in model's :class:`Release`, in the catalog's order: each family with models
    names them in its ``release`` module's ``RELEASES``, exactly the models its ``models`` lists."""
    found: dict[str, Release] = {}
    for family, record in FAMILIES.items():
        if not record.models:
            continue
        releases = importlib.import_module(module_name(family, "release")).RELEASES
        named = sorted(r.name for r in releases)
        if named != sorted(m.name for m in record.models):
            raise ImportError(f"{module_name(family, 'release')}.RELEASES {named} differ from its models.py")
        found.update((r.name, r) for r in releases)
    return {name: found[name] for name in MODEL_NAMES}


# "flux" is FLUX.1-dev; "wan" is Wan2.1-T2V-14B and "wan-1.3b" its 1.3B sibling.
RELEASES: dict[str, Release] = _read_releases()

_TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerBase]] = {
    "qwen": build_tokenizer,
    "clip": build_clip_tokenizer,
    "t5": build_t5_tokenizer,
}


def require_model(name: str) -> str:
    """The canonical name of ``name``; ValueError listing the models otherwise."""
    model = canonical_name(name)
    if model is None:
        raise ValueError(f"unknown embedded model {name!r}: expected one of {', '.join(map(repr, MODEL_NAMES))}")
    return model


def _record(name: str) -> ModelRecord:
    record = known_model(require_model(name))
    assert record is not None  # require_model raised otherwise
    return record


def check_size(size: str) -> str:
    """``size`` if it is one of :data:`SIZES`; ValueError naming them otherwise."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(map(repr, SIZES))}")
    return size


def release(name: str) -> Release:
    """The release data of the built-in model ``name`` (any of its aliases)."""
    return RELEASES[require_model(name)]


def pipeline_class(name: str) -> type[DiffusionPipeline]:
    """The diffusers pipeline class of the built-in model ``name``."""
    import diffusers

    # FluxPipeline's package imports CLIP and SigLIP image processors for its optional image
    # inputs, and without torchvision transformers warns, once per process, that it falls back
    # to their PIL versions. Text-to-image never uses them, so that warning would only be noise
    # on every FLUX run. Imported here rather than at the top, so other runs never import it.
    quiet = logging.getLogger("transformers.utils.import_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return getattr(diffusers, _record(name).pipeline)
    finally:
        quiet.setLevel(level)


def transformer_class(name: str) -> type[torch.nn.Module]:
    """The denoiser class of the built-in model ``name``."""
    return release(name).transformer.cls


def transformer_config(name: str, size: str) -> dict[str, Any]:
    """Constructor kwargs of the denoiser of ``name`` at ``size``."""
    part = release(name).transformer
    return part.config(check_size(size))


def full_transformer_config(name: str) -> dict[str, Any]:
    """Constructor kwargs of the released denoiser of ``name`` (random weights, real shapes)."""
    return transformer_config(name, "full")


def vae_config(name: str, size: str) -> dict[str, Any]:
    """Constructor kwargs of the VAE of ``name`` at ``size``."""
    part = release(name).vae
    return part.config(check_size(size))


def scheduler_config(name: str) -> dict[str, Any]:
    """Constructor kwargs of the released scheduler of ``name`` (the same at both sizes): its
    class's defaults with what the release sets beyond them.

    Wan2.1's is a :class:`UniPCMultistepScheduler`, the others' a FlowMatchEulerDiscreteScheduler.
    """
    model = release(name)
    return {**init_defaults(model.scheduler_class), **model.scheduler}


def build_tokenizers(name: str) -> dict[str, PreTrainedTokenizerBase]:
    """The offline tokenizers of ``name``, by pipeline component name (shared objects: do not mutate)."""
    encoders = release(name).text_encoders
    return {_tokenizer_of(component): _TOKENIZERS[part.tokenizer]() for component, part in encoders.items()}


def _tokenizer_of(text_encoder: str) -> str:
    # text_encoder -> tokenizer, text_encoder_2 -> tokenizer_2: diffusers' component names.
    return text_encoder.replace("text_encoder", "tokenizer")


def _padded_vocab(n_tokens: int) -> int:
    # Rounded up like the real vocabularies (multiples of 64) so embedding shapes stay aligned.
    return ((n_tokens + 63) // 64) * 64


def _token_ids(part: Part, tok: PreTrainedTokenizerBase) -> dict[str, int]:
    """The special ids of the text model's config, as its tokenizer has them."""
    if part.tokenizer == "qwen":
        ids = special_token_ids(tok)
        return dict(
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
        )
    if part.tokenizer == "clip":
        # The pooled output is read at the first eos of each row, so eos must be the tokenizer's.
        return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _encoder_config(
    model: str, component: str, size: str, tokenizer: PreTrainedTokenizerBase | None
) -> PreTrainedConfig:
    part = release(model).text_encoders[component]
    kwargs = part.config(check_size(size))
    tok = tokenizer if tokenizer is not None else _TOKENIZERS[part.tokenizer]()
    # A vision-language encoder (Qwen2.5-VL) keeps its text model's settings in text_config.
    text = kwargs.get("text_config", kwargs)
    if size == "tiny":
        text["vocab_size"] = _padded_vocab(len(tok))
    text.update(_token_ids(part, tok))
    if "vision_config" in kwargs:
        ids = special_token_ids(tok)
        kwargs.update(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    if part.config_class is None:
        raise TypeError(f"{model}'s {component} names no config_class: a text encoder's data must")
    return part.config_class(**kwargs)


def text_encoder_config(name: str, size: str, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedConfig:
    """Config of the (first) text encoder of ``name`` at ``size``.

    Special token ids are those of ``tokenizer`` (the model's offline one by default), so
    generation-side ids (pad, eos, image tokens) agree with what the pipeline's tokenizer produces.
    """
    return _encoder_config(require_model(name), "text_encoder", size, tokenizer)


def text_encoder_2_config(name: str, size: str, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedConfig:
    """Config of the second text encoder of ``name`` at ``size``: FLUX.1's T5-XXL, the only one."""
    model = require_model(name)
    check_size(size)
    if "text_encoder_2" not in RELEASES[model].text_encoders:
        having = ", ".join(n for n, r in RELEASES.items() if "text_encoder_2" in r.text_encoders)
        raise ValueError(f"{model} has one text encoder; only {having} has a text_encoder_2")
    return _encoder_config(model, "text_encoder_2", size, tokenizer)


def components(name: str) -> Mapping[str, Part]:
    """Every component of ``name`` that has weights, by pipeline component name."""
    r = release(name)
    return {"transformer": r.transformer, "vae": r.vae, **r.text_encoders, **r.image_encoders}


def constructor(
    name: str, component: str, size: str, tokenizer: PreTrainedTokenizerBase | None = None
) -> Callable[[], torch.nn.Module]:
    """A function that constructs ``component`` of ``name`` at ``size`` (its config read now).

    Called where the caller chose device, dtype and seed (:func:`pipelines.construction.seeded`, or
    :func:`pipelines.construction.constructing_on` the ``meta`` device to count bytes).
    """
    model = require_model(name)
    if component in ("text_encoder", "text_encoder_2"):
        read = text_encoder_2_config if component == "text_encoder_2" else text_encoder_config
        config = read(model, size, tokenizer)  # ValueError for a text_encoder_2 the model lacks
        cls = RELEASES[model].text_encoders[component].cls
        return lambda: cls(config)
    part = components(model)[component]
    if part.config_class is not None:  # an image encoder: a transformers model built from its config
        vision = part.config_class(**part.config(check_size(size)))
        return lambda: part.cls(vision)
    kwargs = part.config(check_size(size))
    return lambda: part.cls(**kwargs)
