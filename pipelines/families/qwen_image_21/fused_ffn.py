"""Qwen-Image 2.1's SwiGLU feed-forward handing its float8 down projection the product's factors (``compile=True``).

Each block's ``img_mlp`` computes ``out(silu(gate_layer(x)) * proj(x))``. With the library's
float8 layers (``quantize="fp8"`` with ``Recipe.fp8_layers = "scaled-mm"``) that product is
written out in bf16 only for ``out`` to read it again and quantize it. Where ``out`` offers
``forward_after_silu_mul`` (:class:`~accel.hooks.fp8.scaled_mm.Float8RowwiseLinear`), this form
hands it the two up projections' outputs instead: one pass computes the SiLU and the product and
quantizes them (:func:`accel.hooks.fp8.row_quant.quantize_silu_mul_rows_e4m3`), and the product
is never written out.

Decided at each call, as :mod:`accel.hooks.compiled.fused` does for the GELU: the float8 layers
change while ``fp8_budget`` selects them, and a layer measured through its wrapped forward, a bf16
or torchao layer, a LoRA layer, or a call that records gradients takes diffusers' path. Only with
``compile=True`` (the recipe's compiled forms), whose rule is graphs equal to the same compiled
model without graphs: the kernel's SiLU uses the fast exponential, as inductor's does. The code it
stands in for is diffusers 0.42's (the recipe pins that range).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from accel import patch

__all__ = ["fuse_swiglu_quantization"]

logger = logging.getLogger(__name__)

WHY = "qwen-image-2.1: a float8 down projection quantizes silu(gate) * up in one pass (compile=True)"


def _stock_feed_forward(module: torch.nn.Module) -> bool:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21SwiGLUFeedForward

    return (
        type(module) is QwenImage21SwiGLUFeedForward
        and type(module).forward is QwenImage21SwiGLUFeedForward.forward
        and "forward" not in vars(module)
        and type(getattr(module, "activation_fn", None)) is torch.nn.SiLU
    )


def _forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    stock = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        down = module.out
        if (
            not torch.is_grad_enabled()
            and callable(getattr(down, "forward_after_silu_mul", None))
            # While quantize="fp8" measures the layer its forward is wrapped: the measured path.
            and "forward" not in vars(down)
        ):
            return down.forward_after_silu_mul(module.gate_layer(hidden_states), module.proj(hidden_states))
        return stock(module, hidden_states)

    return forward


def fuse_swiglu_quantization(model: torch.nn.Module) -> Callable[[], None]:
    """Give ``model``'s diffusers SwiGLU feed-forwards the forward of the module docstring until the
    returned undo is called. Call it before the blocks are compiled: dynamo traces what the forward
    is then."""
    held = [patch(m, "forward", _forward(m), why=WHY, where="dict") for m in model.modules() if _stock_feed_forward(m)]
    if held:
        logger.info(
            "%s: %d SwiGLU feed-forwards hand a float8 down projection its factors", type(model).__name__, len(held)
        )
    return lambda: [p.undo() for p in reversed(held)] and None
