"""Recipes: what the library knows of a model family, behind one interface.

Owns the :class:`~accel.hooks.recipes.recipe.Recipe` interface (breaks, call normalisation,
warm-up calls, generation defaults), the generic recipe every diffusers denoiser gets, the
registry that finds a model's recipe (the ``bcg_diffusers.recipes`` entry points: recipes live in
pipelines/, never imported here by name), and the padding gate (a recipe pads only while every
attention processor takes its mask and every attention backend in use applies it: ``mask_backends``
asks diffusers' registry which do).

The modules: ``recipe`` (the interface and its warm-up case), ``generic``, ``registry``,
``mask_backends`` and ``padding_gate``.

May import: :mod:`accel.graphs`, and of this layer the base modules (``options``,
``components``, ``call_shape``). Nothing of the other subpackages.
"""

from .generic import GenericRecipe
from .recipe import DEFAULT_WARMUP_PROMPT, WARMUP_ARGUMENTS, GenerationDefaults, Recipe, RecipeError, WarmupCase
from .registry import recipe_for, register_recipe

__all__ = [
    "DEFAULT_WARMUP_PROMPT",
    "WARMUP_ARGUMENTS",
    "GenerationDefaults",
    "GenericRecipe",
    "Recipe",
    "RecipeError",
    "WarmupCase",
    "recipe_for",
    "register_recipe",
]
