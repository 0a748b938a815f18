"""Compiled forms: what ``compile=True`` puts inside the graphs.

Owns the regional compile of a denoiser's repeated blocks and its persistent cache, the GELU(tanh)
projections fused into their GEMM's epilogue, per-head norms with their rotation, a residual's
gated update, and the components' GroupNorms and VAE channel RMS norms through inductor.
Graphs over compiled blocks are held to the same compiled model run without graphs.

The modules: ``compile`` (the regional compile and its cache), ``fused`` (work inductor cannot
fuse, given to it as one op), ``head_norm`` and ``head_norm_kernel`` (per-head RMS norm and
rotary product in one pass), ``gated_residual`` and ``gated_residual_kernel`` (a residual's
``hidden + tanh(gate) * out`` in one pass), ``group_norm`` (GroupNorm for the components), ``channel_norm``
(the channel RMS norm of diffusers' causal video VAEs, for the components), ``same_calls`` (the
library's own ops called twice with the same arguments in a block, run once).

May import: :mod:`accel.graphs` and the base module ``options``; nothing of the other subpackages.
"""

from .channel_norm import compile_channel_norms
from .compile import compile_options
from .fused import fuse_gelu_epilogues

__all__ = ["compile_channel_norms", "compile_options", "fuse_gelu_epilogues"]
