"""Z-Image: a 6B single-stream DiT with a Qwen3-4B text encoder and FLUX.1's VAE; Z-Image Omni, the
same DiT reading condition images through the VAE and a SigLIP2 vision tower.

models    ``FAMILY``: the built-in models ``z-image`` and ``z-image-omni`` and how they are run
recipe    :class:`~pipelines.families.z_image.recipe.ZImageRecipe` (caption padding, context-parallel plan)
omni      the recipe's omni mode (``ZImageOmniPipeline``): its call, breaks and warm-up
release   ``Z_IMAGE`` and ``Z_IMAGE_OMNI``, the released configs and tiny models of the same structure
steps     the pipeline's loop one step at a time, for rows at their own steps (:mod:`pipelines.stepwise`)
"""
