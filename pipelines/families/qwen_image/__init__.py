"""Qwen-Image: a 20B double-stream DiT with a Qwen2.5-VL-7B text encoder and its own VAE; Qwen-Image
Layered, the same DiT splitting an RGBA image into layers.

models    ``FAMILY``: the built-in models ``qwen-image`` and ``qwen-image-layered`` and how they are run
recipe    :class:`~pipelines.families.qwen_image.recipe.QwenImageRecipe` (text padding, true CFG)
guidance  true CFG's two calls: which branch a call is, its output uncomputed (``parallel="cfg"``), the two joined (``cfg_batch``)
layered   what ``QwenImageLayeredPipeline``'s call needs (image and resolution, a prompt, decoded output)
release   ``QWEN_IMAGE`` and ``QWEN_IMAGE_LAYERED``, the released configs and tiny models of the same structure
forms     rotary embeddings in real arithmetic (``compile=True``)
mask_helper the text-mask helper with its length filled on the device, so it captures
modulation the blocks' modulation computed once per step for both guidance calls
fused_norms the second modulated LayerNorm writes the feed-forward's float8 input (``compile=True``, opted in: ``QwenImageRecipe.fused_norm_fp8``)
steps     the pipeline's loop one step at a time, for rows at their own steps (:mod:`pipelines.stepwise`)
"""
