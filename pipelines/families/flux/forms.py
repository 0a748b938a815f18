"""FLUX.1's compiled form: its single-stream blocks without their concatenated copy (the one thing
:class:`pipelines.families.flux.recipe.FluxRecipe` adds to the generic recipe).

The generic recipe captures FLUX.1 whole (bit for bit, no breaks) and its warm-up reads the
pipeline's distilled guidance from the call; nothing of that changes here. What FLUX.1 adds is
in its 38 single-stream blocks (diffusers 0.42's ``FluxSingleTransformerBlock.forward``)::

    mlp = GELU_tanh(proj_mlp(norm))                 # nn.GELU, not diffusers' GELU module
    out = proj_out(cat([attention(norm), mlp], -1))

Compiled as written, the GELU is one more kernel that reads and writes the 4x-wide MLP
activation, and the concatenation copies it (and the attention output) once more before
``proj_out`` reads it: at 1024x1024 about 0.25 GB of traffic per block that no product needs.
:func:`single_blocks_without_concat` gives every such block a forward that computes the GELU in
the projection's epilogue (:func:`accel.addmm_gelu_tanh`, as the library does for diffusers'
``GELU`` modules) and splits ``proj_out`` over its input columns, ``attention @ W[:, :d].T +
mlp @ W[:, d:].T + b``, which is the same product without the concatenated copy.

Equal in real arithmetic, not bit for bit (the GELU runs on the fp32 accumulator, the product's
sum is split in two): applied only with ``compile=True``, whose rule is graphs equal to the same
compiled model without graphs, and only on the diffusers range it was written against
(:data:`FORM_VERSIONS`); elsewhere the blocks compile as diffusers wrote them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from accel import addmm_gelu_tanh, diffusers_in, fusable_linear, patch

__all__ = ["FORM_VERSIONS", "single_blocks_without_concat"]

logger = logging.getLogger(__name__)

# The diffusers whose FluxSingleTransformerBlock.forward the form below restates.
FORM_VERSIONS = ">=0.42,<0.43"
WHY = "single-stream block without the concatenated copy (compile=True)"


def _form_applies(block: torch.nn.Module) -> bool:
    act = block.act_mlp
    return (
        not torch.is_grad_enabled()  # the fused op has no backward
        and fusable_linear(block.proj_mlp)  # not a LoRA layer or quantised weights, which the form would bypass
        and fusable_linear(block.proj_out)
        and type(act) is torch.nn.GELU
        and act.approximate == "tanh"
    )


def _forward(block: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    stock = type(block).forward

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _form_applies(block):
            return stock(block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
        mlp, out = block.proj_mlp, block.proj_out
        mlp_hidden_states = addmm_gelu_tanh(norm_hidden_states, mlp.weight, mlp.bias)
        attn_output = block.attn(
            hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
        )
        d = attn_output.shape[-1]
        projected = F.linear(attn_output, out.weight[:, :d], out.bias) + F.linear(mlp_hidden_states, out.weight[:, d:])
        hidden_states = residual + gate.unsqueeze(1) * projected
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]

    return forward


def single_blocks_without_concat(model: torch.nn.Module) -> Callable[[], None]:
    """Give ``model``'s diffusers ``FluxSingleTransformerBlock``s the forward described above until
    the returned undo is called. Blocks of another class (a subclass too), with a forward of their
    own, or under another diffusers than :data:`FORM_VERSIONS` keep theirs. Call it before the
    blocks compile: dynamo traces what the forward is then."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    ok, installed = diffusers_in(FORM_VERSIONS)
    if not ok:
        logger.info(
            "flux: diffusers %s is outside %s; single-stream blocks compile as they are", installed, FORM_VERSIONS
        )
        return lambda: None
    held = [
        patch(block, "forward", _forward(block), why=WHY, where="dict")
        for block in model.modules()
        if type(block) is FluxSingleTransformerBlock and "forward" not in vars(block)
    ]
    if held:
        logger.info("%s: %d single-stream blocks without the concatenated copy", type(model).__name__, len(held))
    return lambda: [p.undo() for p in reversed(held)] and None
