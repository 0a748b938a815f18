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

Where the feed-forward's down projection is in float8 (``quantize="fp8"``), the GELU's output is
only read to be quantized: a layer that offers ``forward_after_gelu_tanh(pre)``
(:class:`~accel.hooks.fp8.scaled_mm.Float8RowwiseLinear`) computes the GELU inside its input's
one-pass quantization, and the feed-forward (diffusers' ``FeedForward``) hands it the up
projection's output instead, so the GELU's activation is never written out. Decided at each call
(the layers change while ``fp8_budget`` selects them); any other layer takes the stock path, as does
a layer whose forward is wrapped (the selection measuring it against bf16 through its forward).

A SwiGLU feed-forward (``down(silu(gate(x)) * up(x))``: Qwen-Image 2.1's, Z-Image's) is the same
case with two inputs: :func:`fuse_swiglu_inputs` hands a down projection that offers
``forward_after_silu_mul(gate, up)`` the two up projections' outputs, and its one-pass quantization
computes the SiLU and the product (:func:`~accel.hooks.fp8.row_quant.quantize_silu_mul_rows_e4m3`).
Which classes compute that, and under which names, the model's recipe says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...graphs.patches import patch

__all__ = ["addmm_gelu_tanh", "fusable_linear", "fuse_gelu_epilogues", "fuse_swiglu_inputs"]

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


def _takes_its_input_fused(layer: torch.nn.Module, method: str) -> bool:
    """Whether ``layer`` offers ``method`` (a float8 layer of the library's) and may be called
    through it now: no gradients recorded (the op has no backward), and its forward not wrapped
    (while quantize="fp8" measures a layer its forward is wrapped: the measured path)."""
    return not torch.is_grad_enabled() and callable(getattr(layer, method, None)) and "forward" not in vars(layer)


def _inactive_dropout(m: torch.nn.Module) -> bool:
    return type(m) is torch.nn.Dropout and (not m.training or m.p == 0)


def _gelu_input_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    stock = type(module).forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        net = module.net
        down = net[2]
        if (
            not args
            and not kwargs
            and _takes_its_input_fused(down, "forward_after_gelu_tanh")
            and all(_inactive_dropout(m) for i, m in enumerate(net) if i not in (0, 2))
        ):
            return down.forward_after_gelu_tanh(net[0].proj(hidden_states))
        return stock(module, hidden_states, *args, **kwargs)

    return forward


def _gelu_feed_forward(module: torch.nn.Module) -> bool:
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    net = getattr(module, "net", None)
    return (
        type(module) is FeedForward
        and type(module).forward is FeedForward.forward
        and "forward" not in vars(module)
        and isinstance(net, torch.nn.ModuleList)
        and len(net) in (3, 4)
        and type(net[0]) is GELU
        and net[0].approximate == "tanh"
        and type(net[1]) is torch.nn.Dropout
        and (len(net) == 3 or type(net[3]) is torch.nn.Dropout)
    )


def fuse_gelu_epilogues(model: torch.nn.Module) -> Callable[[], None]:
    """Give ``model``'s diffusers ``GELU(approximate="tanh")`` modules a forward with the GELU in
    the product's epilogue (:func:`addmm_gelu_tanh`), and the feed-forwards around them one that
    lets a float8 down projection take the GELU into its quantization, until the returned undo is
    called. Call it before the blocks are compiled: dynamo traces what the forward is then."""
    from diffusers.models.activations import GELU

    held, feed_forwards = [], 0
    for module in model.modules():
        if _gelu_feed_forward(module):
            feed_forwards += 1
            why = "a float8 down projection quantizes the GELU's output in one pass (compile=True)"
            held.append(patch(module, "forward", _gelu_input_forward(module), why=why, where="dict"))
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
        logger.info(
            "%s: %d GELU(tanh) projections fused into their matrix products; %d feed-forwards hand a float8 "
            "down projection the GELU's input",
            type(model).__name__,
            len(held) - feed_forwards,
            feed_forwards,
        )
    return lambda: [p.undo() for p in reversed(held)] and None


def _swiglu_forward(module: torch.nn.Module, gate: str, up: str, down: str) -> Callable[[torch.Tensor], torch.Tensor]:
    stock = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        layer = getattr(module, down)
        if _takes_its_input_fused(layer, "forward_after_silu_mul"):
            return layer.forward_after_silu_mul(
                getattr(module, gate)(hidden_states), getattr(module, up)(hidden_states)
            )
        return stock(module, hidden_states)

    return forward


def fuse_swiglu_inputs(
    model: torch.nn.Module, feed_forward: type, gate: str, up: str, down: str, why: str
) -> Callable[[], None]:
    """Give ``model``'s modules of class ``feed_forward`` (whose own forward computes
    ``down(silu(gate(x)) * up(x))``, with those attribute names) a forward that lets a float8 down
    projection take the SiLU and the product into its quantization (see the module docstring),
    until the returned undo is called. Call it before the blocks are compiled."""
    held = [
        patch(m, "forward", _swiglu_forward(m, gate, up, down), why=why, where="dict")
        for m in model.modules()
        if type(m) is feed_forward and "forward" not in vars(m)
    ]
    if held:
        logger.info(
            "%s: %d SwiGLU feed-forwards hand a float8 down projection its factors", type(model).__name__, len(held)
        )
    return lambda: [p.undo() for p in reversed(held)] and None
