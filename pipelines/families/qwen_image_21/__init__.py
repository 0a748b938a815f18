"""Qwen-Image 2.1: a 7B single-stream block-causal DiT, a Qwen3-VL-8B text encoder reading the prompt
and any condition images together, and its own 16x RGBA VAE.

models     ``FAMILY``: the built-in model ``qwen-image-2.1`` and how it is run
recipe     :class:`~pipelines.families.qwen_image_21.recipe.QwenImage21Recipe` (the K/V cache as state, the masks read once per call)
layout     the forward with its host-side token layout as one keyed break (``layout_forward``, ``LayoutMemo``)
release    ``QWEN_IMAGE_21``, the released configs and a tiny model of the same structure
processor  the offline Qwen3-VL processor its pipeline reads prompts and images through
fused_norms  the modulated norms write their float8 consumers' input (``compile=True``, the library's float8 layers)
head_norms  the query and key head norms and their rotation as one op each (``compile=True``; ``QwenImage21Recipe.fused_head_norms``)
residuals  the gated residual updates as one op each (``compile=True``; ``QwenImage21Recipe.fused_residuals``)
"""
