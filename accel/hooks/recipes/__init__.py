"""Recipes: what the library knows of a model family, behind one interface.

Owns the :class:`~accel.hooks.recipes.recipe.Recipe` interface (breaks, call normalisation,
warm-up calls, generation defaults), the generic recipe every diffusers denoiser gets, the
registry that finds a model's recipe (the ``bcg_diffusers.recipes`` entry points: recipes live in
pipelines/, never imported here by name), and the padding gate (a recipe pads only while every
attention processor takes its mask and every attention backend in use applies it: ``mask_backends``
asks diffusers' registry which do).

May import: :mod:`accel.graphs`, and of this layer the base modules (``options``,
``components``, ``call_shape``). Nothing of the other subpackages.
"""
