"""Qwen-Image: a 20B double-stream DiT with a Qwen2.5-VL-7B text encoder and its own VAE.

models    ``FAMILY``: the built-in model ``qwen-image`` and how it is run
recipe    :class:`~pipelines.families.qwen_image.recipe.QwenImageRecipe` (text padding, the mask helper's break, true CFG)
release   ``QWEN_IMAGE``, the released configs and a tiny model of the same structure
forms     rotary embeddings in real arithmetic (``compile=True``)
"""
