"""Fused kernels for compiled blocks: work inductor cannot fuse, given to it as one op.

With ``compile=True`` inductor fuses the pointwise work of a block into a few Triton kernels, but
it cannot put an activation into a cuBLAS matrix product: diffusers' ``GELU(approximate="tanh")``
feed-forward input (FLUX.1, Qwen-Image, SD3, Wan) compiles to the product, then one more kernel
that reads and writes the whole hidden activation again for the GELU (Qwen-Image at 1024x1024:
3% of a step, samples/profile/). cuBLASLt computes the GELU in the product's epilogue, on the
accumulator before it is rounded, and ATen exposes it as ``_addmm_activation(use_gelu=True)`` on
CUDA (tanh-approximated there).

:func:`fuse_gelu_epilogues` gives every such module of a model a forward that calls
:func:`addmm_gelu_tanh`, a custom op, so dynamo and inductor see one opaque call (inductor would
decompose ``_addmm_activation`` back into the two kernels) and graphs capture it like any kernel.
The result is the same function in real arithmetic, not bit for bit the stock one (the GELU runs
in fp32 before rounding): applied only with ``compile=True``, whose exactness rule is graphs
equal to the same compiled model without graphs; the distance to stock eager is published with
the benchmarks. Modules whose class or forward is not diffusers' own are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...graphs.patches import patch

__all__ = ["addmm_gelu_tanh", "fusable_linear", "fuse_gelu_epilogues"]

logger = logging.getLogger(__name__)


@torch.library.custom_op("bcg_diffusers::addmm_gelu_tanh", mutates_args=())
def addmm_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(x @ weight.T + bias, approximate="tanh")`` over the last dimension of ``x``; on CUDA
    with the GELU in cuBLASLt's epilogue (one kernel), elsewhere as the two ops."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda and bias is not None and x2.shape[0] > 1:
        out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    else:
        out = F.gelu(F.linear(x2, weight, bias), approximate="tanh")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@addmm_gelu_tanh.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_FUSABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fusable_linear(m: torch.nn.Module) -> bool:
    """Whether :func:`addmm_gelu_tanh` may read ``m``'s weight directly: a plain ``nn.Linear`` in
    a dtype it fuses. A projection someone replaced or wrapped since (a LoRA layer, quantised
    weights) changes the class or the parameter, and fusing would bypass it."""
    return type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter and m.weight.dtype in _FUSABLE_DTYPES


def _fused_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    stock = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        proj = module.proj
        # A call that records gradients runs the stock way too: the op has no backward.
        if not torch.is_grad_enabled() and fusable_linear(proj):
            return addmm_gelu_tanh(hidden_states, proj.weight, proj.bias)
        return stock(module, hidden_states)

    return forward


def fuse_gelu_epilogues(model: torch.nn.Module) -> Callable[[], None]:
    """Give ``model``'s diffusers ``GELU(approximate="tanh")`` modules a forward with the GELU in
    the product's epilogue (:func:`addmm_gelu_tanh`) until the returned undo is called. Call it
    before the blocks are compiled: dynamo traces what the forward is then."""
    from diffusers.models.activations import GELU

    held = []
    for module in model.modules():
        if (
            type(module) is GELU
            and module.approximate == "tanh"
            and type(module).forward is GELU.forward
            and "forward" not in vars(module)
            and isinstance(getattr(module, "proj", None), torch.nn.Linear)
        ):
            why = "GELU in the matrix product's epilogue (compile=True)"
            held.append(patch(module, "forward", _fused_forward(module), why=why, where="dict"))
    if held:
        logger.info("%s: %d GELU(tanh) projections fused into their matrix products", type(model).__name__, len(held))
    return lambda: [p.undo() for p in reversed(held)] and None
