"""Ulysses attention with one all-to-all for query, key and value together.

diffusers' ``TemplatedUlyssesAttention`` sends query, key and value in three all-to-alls, each
after a permuting copy, and copies each again into the attention's layout on arrival: per
attention, four all-to-alls (and an all-gather where a mask comes) and eight copies of a
sequence shard; inside a graph, every collective also leaves the GPU idle for tens of
microseconds. :func:`install` puts in its place (while at least one install is held) a
forward-only version that:

* writes the three into one buffer laid out ``[rank, token, batch, q|k|v, head, dim]`` (three
  permuting copies, as before) and sends it in **one** all-to-all, whose larger message NCCL moves
  at a higher rate than three small ones; a boolean key mask of the shard's tokens (Qwen-Image's
  text mask) rides in the same message instead of an all-gather of its own;
* hands the received buffer to the attention op as strided views, no copies (the op's kernels
  read any stride as long as the head dimension is contiguous);
* sends the output back in one all-to-all and copies it once into ``[batch, token, head, dim]``.

The data movement is exact: every element lands where diffusers' version puts it, so only the
attention kernel's reading order can differ (within a run, graphs and eager agree bit for bit).
Calls it does not cover go to diffusers' version unchanged: inside ``torch.compile`` (compiled
blocks; inductor fuses diffusers' copies into their producers), gradients wanted, ``return_lse``
(ring attention), a key sequence of another length than the query's, a mask of another type or
shape. On a diffusers without the class, :func:`install` changes nothing and says so.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Columns added to each token's row for a mask: one carries it, the rest keep rows 16-byte aligned.
_PAD = 8

_lock = threading.Lock()
_holds = 0
_stock: Any = None


class FusedUlyssesAttention:
    """Drop-in for diffusers' ``TemplatedUlyssesAttention`` (its ``apply`` signature), inference only."""

    @staticmethod
    def apply(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        forward_op: Any,
        backward_op: Any,
        _parallel_config: Any = None,
    ) -> Any:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
        if not _covers(query, key, value, attn_mask, return_lse):
            return _stock.apply(*args, forward_op, backward_op, _parallel_config)
        from diffusers.models.attention_dispatch import _all_to_all_single

        cp = _parallel_config.context_parallel_config
        world = cp.ulysses_degree
        group = cp._ulysses_mesh.get_group()
        batch, tokens, heads, dim = query.shape
        local = heads // world
        width = 3 * local * dim
        # A local key mask rides along as one more column (every rank needs every rank's: the
        # all-to-all hands each the others' copies, in rank order, as an all-gather would).
        extra = _PAD if attn_mask is not None else 0
        # Rank r receives every rank's tokens of head group r: the rank axis goes first.
        send = query.new_empty((world, tokens, batch, width + extra))
        qkv = send[..., :width].view(world, tokens, batch, 3, local, dim)
        for i, x in enumerate((query, key, value)):
            qkv[:, :, :, i].copy_(x.reshape(batch, tokens, world, local, dim).permute(2, 1, 0, 3, 4))
        if attn_mask is not None:
            send[..., width].copy_(attn_mask.reshape(batch, tokens).t().expand(world, tokens, batch))
        got = _all_to_all_single(send, group).view(world * tokens, batch, width + extra).transpose(0, 1)
        # [batch, all tokens, local heads, dim] each: strided views of what arrived, no copies.
        q, k, v = got[..., :width].unflatten(-1, (3, local, dim)).unbind(2)
        if attn_mask is not None:
            # Contiguous along the keys: SDPA's memory-efficient kernel takes no other mask, and
            # above batch 1 the received column's key axis has a stride of the batch size.
            attn_mask = (got[..., width] != 0).contiguous()[:, None, None, :]
        out = forward_op(
            None,  # no autograd context: _save_ctx=False
            q,
            k,
            v,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            False,
            _save_ctx=False,
            _parallel_config=_parallel_config,
        )
        # Token shard r of the output goes back to rank r.
        back = out.reshape(batch, world, tokens, local, dim).transpose(0, 1).contiguous()
        back = _all_to_all_single(back, group)  # [head group, batch, tokens, local heads, dim]
        return back.permute(1, 2, 0, 3, 4).contiguous().view(batch, tokens, heads, dim)


def _covers(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, return_lse: bool
) -> bool:
    if torch.compiler.is_compiling():
        # Inductor fuses diffusers' permuting copies into the kernels that make q, k and v;
        # writes into slices of one buffer it cannot (measured: slower compiled blocks).
        return False
    if return_lse or query.shape != key.shape or key.shape != value.shape:
        return False
    if len({query.dtype, key.dtype, value.dtype}) != 1 or not query.is_floating_point():
        return False
    batch, tokens = query.shape[:2]
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.shape != (batch, 1, 1, tokens)):
        return False  # only a boolean key mask of this shard's tokens travels with the data
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))


def install() -> bool:
    """Route diffusers' Ulysses attention through :class:`FusedUlyssesAttention` until the
    matching :func:`uninstall`; installs nest. False (nothing changed) on a diffusers without the
    pieces it replaces."""
    global _holds, _stock
    from diffusers.models import attention_dispatch as dispatch

    with _lock:
        if _holds == 0:
            stock = getattr(dispatch, "TemplatedUlyssesAttention", None)
            if stock is None or not hasattr(dispatch, "_all_to_all_single"):
                logger.warning("this diffusers has no TemplatedUlyssesAttention; Ulysses runs diffusers' own way")
                return False
            _stock = stock
            dispatch.TemplatedUlyssesAttention = FusedUlyssesAttention
        _holds += 1
        return True


def uninstall() -> None:
    """Release one :func:`install`; the last puts diffusers' class back."""
    global _holds, _stock
    from diffusers.models import attention_dispatch as dispatch

    with _lock:
        if _holds == 0:
            return
        _holds -= 1
        if _holds == 0:
            dispatch.TemplatedUlyssesAttention = _stock
            _stock = None
