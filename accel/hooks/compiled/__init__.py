"""Compiled forms: what ``compile=True`` puts inside the graphs.

Owns the regional compile of a denoiser's repeated blocks and its persistent cache, the GELU(tanh)
projections fused into their GEMM's epilogue, and GroupNorm through inductor for the components.
Graphs over compiled blocks are held to the same compiled model run without graphs.

May import: :mod:`accel.graphs` and the base module ``options``; nothing of the other subpackages.
"""
