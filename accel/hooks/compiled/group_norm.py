"""GroupNorm through inductor, for the components of a ``compile=True`` pipeline (its VAE decoder).

ATen's GroupNorm reduces each (image, group) pair in one thread block: a 1024x1024 decode of the
FLUX.1 VAE normalises 32 groups of up to 4M values each, so its moments kernel keeps 32 of the
H200's 132 SMs busy and takes half of the decode (docs/benchmarks.md, "Measurements behind the code"). Inductor splits such a reduction over the whole GPU. :func:`compile_group_norms` gives a
component's ``nn.GroupNorm`` modules a forward through one ``torch.compile`` of ``F.group_norm``
(dynamic shapes: one compile serves every layer and resolution), which the component's graphs
capture like any kernel. Every input is handed over as ``(N, C, L)``, detached from what it
views: a decoder's attention normalises a transposed view ``(N, C, HW)`` where its convolutions
normalise ``(N, C, H, W)``; each rank, and each shape of a view's base (dynamo guards a view's
base) and each channel count (dynamo fixes a Parameter's shape), was another compile, and with several batch sizes they passed dynamo's recompile limit,
which ``fullgraph`` made an error in the middle of a call.

Not bit for bit the stock GroupNorm (another reduction order): applied only with ``compile=True``
and ``compiled_forms``, whose rule is graphs equal to the same compiled model without graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .compile import route_forwards

__all__ = ["compile_group_norms"]

WHY = "GroupNorm through inductor (compile=True)"

_compiled: Callable[..., torch.Tensor] | None = None


def _group_norm() -> Callable[..., torch.Tensor]:
    global _compiled
    if _compiled is None:  # one wrapper for the process: its compiled code serves every module
        _compiled = torch.compile(F.group_norm, dynamic=True, fullgraph=True)
    return _compiled


def _forward(module: torch.nn.GroupNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    stock = type(module).forward
    compiled = _group_norm()

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Inductor's kernel has no backward here and helps only on the GPU.
        if not x.is_cuda or torch.is_grad_enabled() or not x.is_floating_point():
            return stock(module, x)
        return _as_rows(compiled, x, module)

    return forward


def _as_rows(compiled: Callable[..., torch.Tensor], x: torch.Tensor, module: torch.nn.GroupNorm) -> torch.Tensor:
    """``compiled`` group norm of ``x`` seen as ``(N, C, L)``: the same values (a group's
    moments are over its channels and every position), one rank for every caller."""
    # Detached, never copied (this runs only without autograd): dynamo guards a view's base, and
    # takes a Parameter's shape as fixed, so the weights of each channel count would be a compile.
    rows = x.reshape(x.shape[0], x.shape[1], -1).detach()
    w, b = (None if p is None else p.detach() for p in (module.weight, module.bias))
    return compiled(rows, module.num_groups, w, b, module.eps).view(x.shape)


def compile_group_norms(module: torch.nn.Module, cache_dir: Path | None = None) -> Callable[[], None] | None:
    """Route ``module``'s ``nn.GroupNorm`` layers (exactly that class, with no forward of their own)
    through inductor until the returned undo is called; None where there are none. Compiles on
    first use, with the kernel cache in ``cache_dir`` (see
    :func:`accel.hooks.compiled.compile.use_compile_cache`)."""
    norms = [m for m in module.modules() if type(m) is torch.nn.GroupNorm and "forward" not in vars(m)]
    return route_forwards(module, norms, _forward, cache_dir, WHY, "GroupNorm layers")
