"""Finding a denoiser's recipe: the registry, the recipes' entry points, the diffusers range they were tested with.

Model recipes live outside the library (the ``pipelines`` package) and are found through the
``bcg_diffusers.recipes`` entry-point group, loaded on the first lookup, or registered with
:func:`register_recipe`. :func:`recipe_for` picks the recipe serving a denoiser's class (nearest
in its MRO; :class:`~accel.hooks.recipes.generic.GenericRecipe` where none does), and
:func:`new_recipe` builds the one a module gets under given options.
"""

from __future__ import annotations

import importlib.metadata
import logging

import torch

from ..options import RECIPE_DEFAULT, AcceleratorOptions
from .generic import GenericRecipe
from .recipe import Recipe

__all__ = [
    "ENTRY_POINT_GROUP",
    "diffusers_in",
    "new_recipe",
    "recipe_for",
    "register_recipe",
    "version_supported",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bcg_diffusers.recipes"

_registry: list[type[Recipe]] = []
_entry_points_loaded = False


def register_recipe(cls: type[Recipe]) -> type[Recipe]:
    """Register a recipe class (usable as a decorator). Later registrations win."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise TypeError(f"expected a Recipe subclass, got {cls!r}")
    if cls not in _registry:
        _registry.append(cls)
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        logger.warning(
            "no recipes found (entry-point group %r is empty): is bcg-diffusers installed "
            "(pip install -e .)? Denoisers get the generic recipe.",
            ENTRY_POINT_GROUP,
        )
    for ep in found:
        try:
            register_recipe(ep.load())
        except Exception as exc:  # a broken plug-in must not take the library down
            logger.warning("could not load recipe %s (%s): %s", ep.name, ep.value, exc)


def recipe_for(module: torch.nn.Module) -> type[Recipe]:
    """The recipe class serving ``module``'s class (nearest in its MRO), or GenericRecipe."""
    _load_entry_points()
    for klass in type(module).__mro__:
        for recipe in reversed(_registry):
            if klass.__name__ in recipe.denoiser_classes:
                return recipe
    return GenericRecipe


def diffusers_in(versions: str) -> tuple[bool, str]:
    """Whether the installed diffusers is inside ``versions`` (a PEP 440 specifier; empty: any),
    and which it is."""
    try:
        installed = importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return False, "not installed"
    if not versions:
        return True, installed
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(installed) in SpecifierSet(versions), installed


def version_supported(recipe: type[Recipe]) -> tuple[bool, str]:
    """Whether the installed diffusers is inside the recipe's tested range, and which it is."""
    return diffusers_in(recipe.diffusers_versions)


def new_recipe(module: torch.nn.Module, options: AcceleratorOptions, *, component: bool = False) -> Recipe:
    """The recipe ``module`` gets under ``options``: the generic one for a ``component`` (a text
    encoder, a VAE decoder), else its class's; built with the user's ``text_buckets`` where the
    recipe pads text and the user named some."""
    recipe_cls = GenericRecipe if component else recipe_for(module)
    if recipe_cls.pads_text and options.text_buckets is not RECIPE_DEFAULT:
        return recipe_cls(text_buckets=options.text_buckets)
    return recipe_cls()
