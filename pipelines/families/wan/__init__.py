"""Wan2.1 text-to-video, 14B and 1.3B, with a UMT5-XXL text encoder and a causal video VAE.

The generic recipe serves its denoiser (captured whole), so the folder has no recipe.

models    ``FAMILY``: the built-in models ``wan`` and ``wan-1.3b`` and how they are run
release   ``WAN_14B`` and ``WAN_1_3B``, the released configs and a tiny model of the same structure
"""
