"""The one catalog of the models this project knows, read without torch (the CLI checks flags
against it before torch and diffusers load, which take 3-5 s).

Families are found by one rule: every package in :mod:`pipelines.families` is a family, and its
``models`` module names a :class:`~pipelines.families.records.Family` ``FAMILY``. Nothing else
lists them; a family's denoiser recipe is found by accel through the ``bcg_diffusers.recipes``
entry point that names ``pipelines.families.<family>.recipe`` (pyproject.toml).

:data:`MODELS` are the built-in models (random weights, offline); their released configs are
each family's ``release`` module, read by :mod:`pipelines.releases`. :data:`BENCHMARK_ZOO` names
the breadth benchmark's separate zoo (:mod:`pipelines.zoo`): denoisers and VAEs without text
encoders, called with random embeddings, never built-in models.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from .. import families
from ..zoo.names import NAMES as BENCHMARK_ZOO
from .records import Family, ModelRecord

__all__ = [
    "ALIASES",
    "BENCHMARK_ZOO",
    "FAMILIES",
    "MODELS",
    "MODEL_NAMES",
    "canonical_name",
    "family_of",
    "known_model",
    "model_generation",
    "module_name",
    "pipeline_generation",
    "video_model_names",
]


def module_name(family: str, part: str) -> str:
    """The module ``part`` (``"models"``, ``"recipe"``, ``"release"``, ``"forms"``) of the family folder ``family``."""
    return f"{families.__name__}.{family}.{part}"


def _find() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(families.__path__):
        if not info.ispkg:
            continue
        family = getattr(importlib.import_module(module_name(info.name, "models")), "FAMILY", None)
        if not isinstance(family, Family):
            raise ImportError(f"{module_name(info.name, 'models')} names no Family FAMILY: every family folder must")
        found[info.name] = family
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[0])))


FAMILIES: dict[str, Family] = _find()
MODELS: tuple[ModelRecord, ...] = tuple(m for f in FAMILIES.values() for m in f.models)
MODEL_NAMES: tuple[str, ...] = tuple(m.name for m in MODELS)
_FAMILY_OF: dict[str, str] = {m.name: name for name, f in FAMILIES.items() for m in f.models}
_BY_ALIAS: dict[str, ModelRecord] = {}
for _model in MODELS:
    for _alias in (_model.name, *_model.aliases):
        if _alias != _alias.strip().lower() or _alias in _BY_ALIAS:
            raise ImportError(f"model name {_alias!r} is not lower case or is taken twice (families: {list(FAMILIES)})")
        _BY_ALIAS[_alias] = _model
# Every spelling a model is known by (its name included), lower case.
ALIASES: dict[str, str] = {alias: m.name for alias, m in _BY_ALIAS.items()}


def known_model(name: str) -> ModelRecord | None:
    """The built-in model ``name`` (any of its spellings, any case) refers to, or None."""
    return _BY_ALIAS.get(name.strip().lower())


def canonical_name(name: str) -> str | None:
    """The built-in model ``name`` refers to (one of :data:`MODEL_NAMES`), or None."""
    model = known_model(name)
    return None if model is None else model.name


def family_of(name: str) -> str:
    """The family folder of the built-in model ``name`` (any spelling); KeyError for another name."""
    model = known_model(name)
    if model is None:
        raise KeyError(name)
    return _FAMILY_OF[model.name]


def video_model_names() -> tuple[str, ...]:
    """The built-in models that make videos, by name."""
    return tuple(m.name for m in MODELS if m.video)


def pipeline_generation(pipeline: str) -> Mapping[str, Any] | None:
    """The generation defaults (``accel.GenerationDefaults``' arguments) of the built-in model
    that builds the pipeline class named ``pipeline`` (its own, else its family's), or None."""
    for family in FAMILIES.values():
        for model in family.models:
            if model.pipeline == pipeline and (model.generation or family.generation) is not None:
                return model.generation or family.generation
    return None


def model_generation(pipeline: str) -> Mapping[str, Any] | None:
    """The generation defaults of the built-in model that builds the pipeline class named
    ``pipeline`` where they are its own (:attr:`ModelRecord.generation`: it runs unlike its
    family, whose recipe speaks for the family's other pipelines), else None."""
    return next((m.generation for m in MODELS if m.pipeline == pipeline and m.generation is not None), None)
