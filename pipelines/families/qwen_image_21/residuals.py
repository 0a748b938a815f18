"""Qwen-Image 2.1's gated residual updates as one op each (``compile=True``).

Each block ends its attention and its feed-forward with ``hidden_states + gate.tanh() * output``.
Under :mod:`.fused_norms` the gate comes as its rows (a :class:`~.fused_norms.TanhGate`); compiled,
inductor still took the tanh per token and channel, and on an H100 the kernel ran at about 90 us
where its bytes take about 33 (docs/benchmarks.md). Under this form the block's forward is diffusers
0.42's with those two lines as :func:`accel.gated_residual`: the rows' tanh once, then one pass.
It gives the tensor ops' bits on the GPU and is them on the CPU
(tests/pipelines/families/test_qwen_image_21_residuals.py).

Decided at each call: a gate that is not a :class:`~.fused_norms.TanhGate` (the stock
``_modulate``, which spreads it) takes diffusers' expression. Applied only to diffusers' own block
class with its own forward; the recipe pins the diffusers range whose forward this copies.
On by default (``QwenImage21Recipe.fused_residuals``): on an H100 the kernel takes about 35 us
and the float8 call is faster with it in the same process (docs/benchmarks.md).

With ``tanh_in_block`` (``QwenImage21Recipe.modulation_in_block``, which also has
:mod:`.fused_norms` make the scales' rows in the block's graph) the block takes both gates' rows
through tanh at its start, in its own compiled graph (one small kernel, or none of its own where
inductor fuses it), and hands them to the op as they are, where the op took an ATen tanh per
update: 64 launches a step at Qwen-Image 2.1's 32 blocks. The rows are the modulation's gate
halves, which is what :mod:`.fused_norms`' ``_modulate`` hands on as a
:class:`~.fused_norms.TanhGate`; without one the stock expression runs and they go unused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.transformers import transformer_qwenimage21 as q21

from accel import gated_residual, patch

from .fused_norms import TanhGate

__all__ = ["fuse_residuals"]

logger = logging.getLogger(__name__)

WHY = "qwen-image-2.1: the gated residual updates in one pass (compile=True)"


def _residual(
    hidden_states: torch.Tensor, gate: Any, output: torch.Tensor, rows_tanh: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(gate, TanhGate) and not torch.is_grad_enabled():  # the op has no backward
        if rows_tanh is not None:
            return gated_residual(hidden_states, output, rows_tanh, gate.mask, tanh=False)
        return gated_residual(hidden_states, output, gate.rows, gate.mask)
    return hidden_states + gate.tanh() * output


def _gate_rows_tanh(mod1: torch.Tensor, mod2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh of both halves' gate rows (``_modulate``'s ``mod_params.chunk(2, dim=-1)[1]``), made in
    one pass, each contiguous."""
    both = torch.tanh(torch.stack((mod1.chunk(2, dim=-1)[1], mod2.chunk(2, dim=-1)[1])))
    return both[0], both[1]


def _forward(block: torch.nn.Module, tanh_in_block: bool = False) -> Callable[..., torch.Tensor]:
    def forward(
        hidden_states: torch.Tensor,
        modulation: torch.Tensor,
        rotary_emb: torch.Tensor | None = None,
        attention_mask: Any | None = None,
        target_token_mask: torch.Tensor | None = None,
        layer_cache: Any | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # diffusers 0.42's QwenImage21TransformerBlock.forward, the residuals as _residual.
        mod1, mod2 = modulation.chunk(2, dim=-1)
        rows1, rows2 = _gate_rows_tanh(mod1, mod2) if tanh_in_block and modulation.dim() == 2 else (None, None)

        img_modulated, img_gate1 = block._modulate(block.img_norm1(hidden_states), mod1, target_token_mask)
        attn_output = block.attn(
            hidden_states=img_modulated,
            attention_mask=attention_mask,
            rotary_emb=rotary_emb,
            layer_cache=layer_cache,
            kv_cache_mode=kv_cache_mode,
            cache_write_slice=cache_write_slice,
            segments=segments,
            key_valid=key_valid,
        )
        hidden_states = _residual(hidden_states, img_gate1, attn_output, rows1)

        img_modulated2, img_gate2 = block._modulate(block.img_norm2(hidden_states), mod2, target_token_mask)
        hidden_states = _residual(hidden_states, img_gate2, block.img_mlp(img_modulated2), rows2)

        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        return hidden_states

    return forward


def _fusable(block: torch.nn.Module) -> bool:
    forward = getattr(type(block), "forward", None)
    return (
        type(block) is q21.QwenImage21TransformerBlock
        and "forward" not in vars(block)
        and getattr(forward, "__module__", None) == q21.__name__
        and getattr(forward, "__qualname__", None) == "QwenImage21TransformerBlock.forward"
    )


def fuse_residuals(model: torch.nn.Module, tanh_in_block: bool = False) -> Callable[[], None]:
    """Give every Qwen-Image 2.1 block of ``model`` this form (see the module docstring; with
    ``tanh_in_block``, the gates' tanh in the block's graph) until the returned undo is called.
    Call it before the blocks compile: dynamo traces what the forwards are then."""
    held = [
        patch(block, "forward", _forward(block, tanh_in_block), why=WHY, where="dict")
        for block in getattr(model, "transformer_blocks", ())
        if _fusable(block)
    ]
    if held:
        logger.info("%s: %d blocks update their residual in one pass", type(model).__name__, len(held))
    return lambda: [p.undo() for p in reversed(held)] and None
