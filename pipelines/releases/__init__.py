"""The built-in models' released configs: what :mod:`pipelines.builders` builds and what
:mod:`pipelines.limits` reads before anything is built.

Each built-in model (Z-Image, Qwen-Image, FLUX.1-dev, Wan2.1 14B and 1.3B: the catalog,
:mod:`pipelines.families.catalog`) is data in its family's folder
(``pipelines/families/<family>/release.py``), at two sizes: ``"full"`` is the release (the
``config.json`` of each component of its hub repository, written as constructor arguments, or
diffusers' constructor defaults where those are the release); ``"tiny"`` keeps every structural
choice at a few layers and narrow widths. This package holds what the families share:

spec        :class:`Part` (a component's class and configs), :class:`Release` (one model)
encoders    the CLIP and T5 text encoders FLUX.1 and Wan2.1 share
configs     the models' releases by name; their classes, configs and tokenizers (the
            accessors: ``from pipelines.releases.configs import ...``)
"""

from __future__ import annotations

from .spec import Part, Release

__all__ = ["Part", "Release"]
