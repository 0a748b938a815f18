"""Qwen-Image 2.1's modulated LayerNorms written straight into their float8 consumers' input (``compile=True``).

In each block ``img_norm1`` (LayerNorm, no affine) and ``_modulate`` (``norm * (1 + scale)``, the
scale row chosen per token by the target-token mask) make the attention's input, which ``to_q``,
``to_k`` and ``to_v`` read; ``img_norm2`` and ``_modulate`` make the feed-forward's, which
``gate_layer`` and ``proj`` read. With the library's float8 layers (``Recipe.fp8_layers =
"scaled-mm"``) each consumer quantizes that activation in a pass of its own, so it is written out
in bf16 only to be read again. Under this form the norm hands on its input (:class:`Normed`),
``_modulate`` the norm's input and the modulation (:class:`Modulated`, a
:class:`~accel.hooks.fp8.scaled_mm.PendingRows`), and each float8 consumer gets its rows from
:func:`accel.hooks.fp8.norm_quant.modulated_norm_rows_e4m3`, which does the norm, the modulation
and the quantization in one pass (the consumers' identical calls run once in a compiled block:
:mod:`accel.hooks.compiled.same_calls`).

Decided at each call, by the norm: only where every consumer of its output is the library's
float8 layer, unwrapped (not being measured by ``fp8_budget``'s selection), and the attention is
diffusers' own module with one of diffusers' two processors (which hand the input straight to
the projections). Anything else takes diffusers' path; ``_modulate`` given a :class:`Normed` it
cannot fuse normalises it as diffusers does. On the CPU the op is the modules' arithmetic, bit for
bit the unfused path (tests/pipelines/families/test_qwen_image_21_fused_norms.py); on CUDA within
a float8 step of it (tests/cuda/test_fused_quant.py). The code it stands in for is diffusers
0.42's (the recipe pins that range).

The same ``_modulate`` hands on the gate as a :class:`TanhGate`, whose only use (``gate.tanh()``
in the block's forward) takes the tanh of the gate's rows before they are spread over the tokens:
bit for bit diffusers' values (the tanh is taken per value either way), but one tanh per row
instead of one per token and channel, which made the residual's kernel bound by its arithmetic.

With ``contiguous_scales`` (``QwenImage21Recipe.modulation_in_block``) ``_modulate`` makes the
scale's rows contiguous in the block's compiled graph, where inductor can make the copy with the
block's other small kernels; the op made it with an ATen copy per norm.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.transformers import transformer_qwenimage21 as q21

import accel
from accel import Float8RowwiseLinear, PendingRows, patch

from ..qwen_image.fused_norms import Normed

__all__ = ["Modulated", "Normed", "TanhGate", "fuse_norm_quantization", "library_float8"]

logger = logging.getLogger(__name__)

WHY = "qwen-image-2.1: the modulated LayerNorms write their float8 consumers' input (compile=True)"


@dataclasses.dataclass
class TanhGate:
    """A block's gate rows (``batch``, or ``batch + 1`` with ``mask``) as ``_modulate`` hands them
    on; :meth:`tanh` is diffusers' ``_select_modulation_rows(rows, mask).tanh()``."""

    rows: torch.Tensor
    mask: torch.Tensor | None

    def tanh(self) -> torch.Tensor:
        return q21._select_modulation_rows(self.rows.tanh(), self.mask)


@dataclasses.dataclass
class Modulated(PendingRows):
    """What ``_modulate`` hands on for a :class:`Normed` input: the norm's input, the scale rows
    (``batch`` of them, or ``batch + 1`` with ``rows`` naming each token's) and the norm's eps."""

    x: torch.Tensor
    scale: torch.Tensor
    rows: torch.Tensor | None
    eps: float

    def e4m3_rows(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        xq, xs = accel.modulated_norm_rows_e4m3(self.x, None, self.scale, self.eps, self.rows)
        return xq, xs, tuple(self.x.shape[:-1])


def library_float8(*layers: torch.nn.Module) -> bool:
    """Whether every one of ``layers`` is the library's float8 layer, unwrapped."""
    # While quantize="fp8" measures a layer its forward is wrapped: the measured path.
    return all(type(m) is Float8RowwiseLinear and "forward" not in vars(m) for m in layers)


def _attention_fusable(attn: torch.nn.Module) -> bool:
    return (
        type(attn) is q21.QwenImage21Attention
        and "forward" not in vars(attn)
        and type(attn.processor) in (q21.QwenImage21AttnProcessor, q21.QwenImage21FlexAttnProcessor)
        and library_float8(attn.to_q, attn.to_k, attn.to_v)
    )


def _feed_forward_fusable(mlp: torch.nn.Module) -> bool:
    return library_float8(mlp.gate_layer, mlp.proj)


def _norm_forward(norm: torch.nn.LayerNorm, fusable: Callable[[], bool]) -> Callable[[torch.Tensor], Any]:
    stock = type(norm).forward

    def forward(x: torch.Tensor) -> Any:
        if not torch.is_grad_enabled() and x.dim() == 3 and fusable():
            return Normed(x, norm.eps)
        return stock(norm, x)

    return forward


def _modulate(block: torch.nn.Module, contiguous_scales: bool = False) -> Callable[..., Any]:
    def stock(hidden_states: torch.Tensor, mod_params: torch.Tensor, mask: torch.Tensor | None) -> Any:
        # diffusers' _modulate, the gate handed on as its rows.
        scale, gate = mod_params.chunk(2, dim=-1)
        return hidden_states * (1 + q21._select_modulation_rows(scale, mask)), TanhGate(gate, mask)

    def modulate(hidden_states: Any, mod_params: torch.Tensor, target_token_mask: torch.Tensor | None) -> Any:
        if not isinstance(hidden_states, Normed):
            return stock(hidden_states, mod_params, target_token_mask)
        x = hidden_states.x
        batch = x.shape[0]
        if mod_params.dim() != 2 or mod_params.shape[0] != batch + (target_token_mask is not None):
            return stock(hidden_states.tensor(), mod_params, target_token_mask)
        scale, gate = mod_params.chunk(2, dim=-1)
        rows = None
        if target_token_mask is not None:
            # diffusers' _select_modulation_rows as row numbers: the sample's row at its target
            # tokens, the last (t = 0) row elsewhere.
            own = torch.arange(batch, device=x.device)[:, None]
            rows = torch.where(target_token_mask.view(1, -1), own, batch).reshape(-1)
        if contiguous_scales:
            scale = scale.contiguous()
        return Modulated(x, scale, rows, hidden_states.eps), TanhGate(gate, target_token_mask)

    return modulate


def _fusable_block(block: torch.nn.Module) -> bool:
    norms = [getattr(block, "img_norm1", None), getattr(block, "img_norm2", None)]
    return (
        type(block) is q21.QwenImage21TransformerBlock
        # The block's own forward is the one reader of what _modulate hands on (a TanhGate).
        and getattr(type(block).forward, "__module__", None) == q21.__name__
        and "_modulate" not in vars(block)
        and all(type(n) is torch.nn.LayerNorm and not n.elementwise_affine and "forward" not in vars(n) for n in norms)
        and type(getattr(block, "img_mlp", None)) is q21.QwenImage21SwiGLUFeedForward
    )


def fuse_norm_quantization(model: torch.nn.Module, contiguous_scales: bool = False) -> Callable[[], None]:
    """Give every Qwen-Image 2.1 block of ``model`` this form (see the module docstring; with
    ``contiguous_scales``, the scales' rows made contiguous in the block's graph) until the
    returned undo is called. Call it before the blocks compile: dynamo traces what the forwards are
    then."""
    held = []
    for block in getattr(model, "transformer_blocks", ()):
        if not _fusable_block(block):
            continue
        attn, mlp = block.attn, block.img_mlp
        norm1 = _norm_forward(block.img_norm1, lambda a=attn: _attention_fusable(a))
        norm2 = _norm_forward(block.img_norm2, lambda m=mlp: _feed_forward_fusable(m))
        held += [
            patch(block.img_norm1, "forward", norm1, why=WHY, where="dict"),
            patch(block.img_norm2, "forward", norm2, why=WHY, where="dict"),
            patch(block, "_modulate", _modulate(block, contiguous_scales), why=WHY, where="dict"),
        ]
    if held:
        logger.info("%s: %d blocks write their float8 inputs in the norms", type(model).__name__, len(held) // 3)
    return lambda: [p.undo() for p in reversed(held)] and None
