"""FLUX.2 [klein]: FLUX.2's double- and single-stream DiT at 4B and 9B, a Qwen3 text encoder (its
hidden layers 9, 18 and 27 stacked) and FLUX.2's 32-channel VAE; the KV variant keeps a reference
image's keys and values from the first step for the later ones.

models    ``FAMILY``: the built-in models ``flux2-klein`` (4B) and ``flux2-klein-kv`` (9B KV) and how they are run
recipe    :class:`~pipelines.families.flux2.recipe.Flux2Recipe` (the K/V cache as request-scoped state, a reference image in the KV warm-up)
release   ``FLUX2_KLEIN_4B``, ``FLUX2_KLEIN_9B_KV``: the released configs and tiny models of the same structure
"""
