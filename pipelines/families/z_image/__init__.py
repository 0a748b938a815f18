"""Z-Image: a 6B single-stream DiT with a Qwen3-4B text encoder and FLUX.1's VAE.

models    ``FAMILY``: the built-in model ``z-image`` and how it is run
recipe    :class:`~pipelines.families.z_image.recipe.ZImageRecipe` (caption padding, context-parallel plan)
release   ``Z_IMAGE``, the released configs and a tiny model of the same structure
"""
