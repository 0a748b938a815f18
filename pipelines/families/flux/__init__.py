"""FLUX.1-dev: a 12B double- and single-stream DiT with CLIP-L and T5-XXL text encoders.

models    ``FAMILY``: the built-in model ``flux`` and how it is run
recipe    :class:`~pipelines.families.flux.recipe.FluxRecipe` (the generic recipe and one compiled form)
release   ``FLUX_1_DEV``, the released configs and a tiny model of the same structure
forms     the single-stream blocks without their concatenated copy (``compile=True``)
"""
