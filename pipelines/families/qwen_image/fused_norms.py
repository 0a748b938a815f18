"""Qwen-Image's second modulated LayerNorm written straight into its feed-forward's float8 input (``compile=True``, opted in).

Off unless ``QwenImageRecipe.fused_norm_fp8`` is set: its kernel passes
tests/cuda/test_fused_quant.py on an H100, but its gain in a full step is not measured yet (see
:mod:`accel.hooks.fp8.norm_quant`).

In each block the image stream's ``img_norm2`` (LayerNorm, no affine), ``_modulate`` (``norm *
(1 + scale) + shift``) and ``img_mlp`` (GELU(tanh) feed-forward) run one after the other; with the
library's float8 layers (``quantize="fp8"``) the feed-forward's up projection quantizes the
modulated activation in a pass of its own, so that activation is written out in bf16 only to be
read again. This form hands the norm's input and the modulation to the up projection instead:
:func:`accel.hooks.fp8.norm_quant.modulated_norm_rows_e4m3` writes the float8 activation and
its row scales in one pass (:meth:`Float8RowwiseLinear.forward_quantized` multiplies them), and
the down projection takes the GELU into its own quantization as
:mod:`accel.hooks.compiled.fused` arranges.

Three small forwards per block, each falling back to diffusers' code where anything differs:
``img_norm2`` returns a :class:`Normed` (the input and the norm's eps) instead of normalising;
``_modulate`` given a :class:`Normed` returns a :class:`Modulated` (input, shift, scale) where
the feed-forward's two projections are the library's float8 layers, else normalises and
modulates as diffusers does; ``img_mlp`` given a :class:`Modulated` runs the fused path. The
block's other uses of the norms and ``_modulate`` (the attention's input, the text stream) are
untouched. On the CPU the op is the modules' own arithmetic, bit for bit the unfused path
(tests/pipelines/families/test_qwen_image_fused_norms.py); on CUDA within a float8 step of it
(tests/cuda/test_fused_quant.py). The code it stands in for is diffusers 0.42's (the recipe pins
that range).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import accel
from accel import Float8RowwiseLinear, patch

__all__ = ["Modulated", "Normed", "fuse_norm_quantization"]

logger = logging.getLogger(__name__)

WHY = "qwen-image: the second modulated LayerNorm writes the feed-forward's float8 input (compile=True)"


@dataclasses.dataclass
class Normed:
    """What ``img_norm2`` hands on under this form: its input, not yet normalised."""

    x: torch.Tensor
    eps: float

    def tensor(self) -> torch.Tensor:
        return F.layer_norm(self.x, (self.x.shape[-1],), eps=self.eps)


@dataclasses.dataclass
class Modulated:
    """What ``_modulate`` hands on for a :class:`Normed` input: the norm's input and the modulation."""

    x: torch.Tensor
    shift: torch.Tensor
    scale: torch.Tensor
    eps: float

    def tensor(self) -> torch.Tensor:
        y = F.layer_norm(self.x, (self.x.shape[-1],), eps=self.eps)
        return y * (1 + self.scale.unsqueeze(1)) + self.shift.unsqueeze(1)


def _float8_feed_forward(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp``'s up and down projections are the library's float8 layers (decided per
    call: the layers change while ``fp8_budget`` selects them)."""
    net = getattr(mlp, "net", None)
    return (
        not torch.is_grad_enabled()
        and isinstance(net, torch.nn.ModuleList)
        and len(net) >= 3
        and type(getattr(net[0], "proj", None)) is Float8RowwiseLinear
        and type(net[2]) is Float8RowwiseLinear
        # While quantize="fp8" measures the layers their forwards are wrapped: the measured path.
        and "forward" not in vars(net[0].proj)
        and "forward" not in vars(net[2])
    )


def _norm_forward(norm: torch.nn.LayerNorm, mlp: torch.nn.Module) -> Callable[[torch.Tensor], Any]:
    stock = type(norm).forward

    def forward(x: torch.Tensor) -> Any:
        if _float8_feed_forward(mlp) and x.dim() == 3:
            return Normed(x, norm.eps)
        return stock(norm, x)

    return forward


def _modulate(block: torch.nn.Module) -> Callable[..., Any]:
    stock = type(block)._modulate

    def modulate(x: Any, mod_params: torch.Tensor, index: Any = None) -> Any:
        if not isinstance(x, Normed):
            return stock(block, x, mod_params, index)
        if index is not None or mod_params.dim() != 2:
            return stock(block, x.tensor(), mod_params, index)
        shift, scale, gate = mod_params.chunk(3, dim=-1)
        return Modulated(x.x, shift, scale, x.eps), gate.unsqueeze(1)

    return modulate


def _mlp_forward(mlp: torch.nn.Module) -> Callable[..., torch.Tensor]:
    stock = mlp.forward  # the feed-forward's forward as it is now (accel.hooks.compiled.fused's, or diffusers')

    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(hidden_states, Modulated):
            return stock(hidden_states, *args, **kwargs)
        if args or kwargs or not _float8_feed_forward(mlp):
            return stock(hidden_states.tensor(), *args, **kwargs)
        m = hidden_states
        xq, xs = accel.modulated_norm_rows_e4m3(m.x, m.shift, m.scale, m.eps)
        up = mlp.net[0].proj.forward_quantized(xq, xs, tuple(m.x.shape[:-1]))
        return mlp.net[2].forward_after_gelu_tanh(up)

    return forward


def _fusable(block: torch.nn.Module) -> bool:
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    norm, mlp = getattr(block, "img_norm2", None), getattr(block, "img_mlp", None)
    return (
        type(norm) is torch.nn.LayerNorm
        and not norm.elementwise_affine
        and "forward" not in vars(norm)
        and "_modulate" not in vars(block)
        and type(mlp) is FeedForward
        and isinstance(mlp.net[0], GELU)
        and mlp.net[0].approximate == "tanh"
        and not getattr(block, "zero_cond_t", False)
    )


def fuse_norm_quantization(model: torch.nn.Module) -> Callable[[], None]:
    """Give every Qwen-Image block of ``model`` this form (see the module docstring) until the
    returned undo is called. Call it after :func:`accel.hooks.compiled.fused.fuse_gelu_epilogues`
    (its feed-forward forward is the one kept as the fallback) and before the blocks compile."""
    held = []
    for block in getattr(model, "transformer_blocks", ()):
        if not _fusable(block):
            continue
        held += [
            patch(block.img_norm2, "forward", _norm_forward(block.img_norm2, block.img_mlp), why=WHY, where="dict"),
            patch(block, "_modulate", _modulate(block), why=WHY, where="dict"),
            patch(block.img_mlp, "forward", _mlp_forward(block.img_mlp), why=WHY, where="dict"),
        ]
    if held:
        logger.info(
            "%s: %d blocks write their feed-forward's float8 input in the norm", type(model).__name__, len(held) // 3
        )
    return lambda: [p.undo() for p in reversed(held)] and None
