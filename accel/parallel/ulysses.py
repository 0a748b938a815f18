"""Ulysses attention with one all-to-all for query, key and value together.

diffusers' ``TemplatedUlyssesAttention`` sends query, key and value in three all-to-alls, each
after a permuting copy, and copies each again into the attention's layout on arrival: per
attention, four all-to-alls (and an all-gather where a mask comes) and eight copies of a
sequence shard; inside a graph, every collective also leaves the GPU idle for tens of
microseconds. :func:`fused_attention` puts in its place (while the patch it returns is held: a
session holds one during each of its denoiser calls) a forward-only version that:

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
shape. On a diffusers without the class, :func:`fused_attention` changes nothing and says so.

This module also enables diffusers' context parallelism on a denoiser (:func:`enable_ulysses`,
undone exactly: diffusers offers no ``disable_parallelism``) and makes a Ulysses group agree on
every capture (:func:`agree_on_capture`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry

from ..graphs.patches import Patch, patch

if TYPE_CHECKING:
    from ..graphs.runner import GraphRunner
    from .agreement import Agreement

__all__ = ["FusedUlyssesAttention", "agree_on_capture", "enable_ulysses", "fused_attention"]

logger = logging.getLogger(__name__)

# Columns added to each token's row for a mask: one carries it, the rest keep rows 16-byte aligned.
_PAD = 8

_stock: Any = None  # diffusers' TemplatedUlyssesAttention, for the calls the fused version leaves to it
_said_missing = False


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


def fused_attention() -> Patch | None:
    """Route diffusers' Ulysses attention through :class:`FusedUlyssesAttention` until the
    returned patch is undone; patches nest. None (nothing changed, said once) on a diffusers
    without the pieces it replaces."""
    global _stock, _said_missing
    from diffusers.models import attention_dispatch as dispatch

    if getattr(dispatch, "TemplatedUlyssesAttention", None) is None or not hasattr(dispatch, "_all_to_all_single"):
        if not _said_missing:
            _said_missing = True
            logger.warning("this diffusers has no TemplatedUlyssesAttention; Ulysses runs diffusers' own way")
        return None
    held = patch(dispatch, "TemplatedUlyssesAttention", FusedUlyssesAttention, why="one all-to-all for q, k and v")
    _stock = held.original
    return held


_MISSING = object()


def enable_ulysses(module: torch.nn.Module, degree: int, mesh: Any, plan: dict[str, Any]) -> Callable[[], None]:
    """``module.enable_parallelism`` with ``plan``; returns what puts the module back exactly."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel

    subs = list(module.modules())
    had_registry = [m.__dict__.get("_diffusers_hook", _MISSING) for m in subs]
    had_forward = ["forward" in m.__dict__ for m in subs]
    processors = [getattr(m, "processor", None) for m in subs]
    had_config = [p.__dict__.get("_parallel_config", _MISSING) if p is not None else _MISSING for p in processors]
    module_config = module.__dict__.get("_parallel_config", _MISSING)
    try:
        module.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh), cp_plan=plan)
    except BaseException:
        _restore_parallel_state(module, subs, had_registry, had_forward, processors, had_config, module_config)
        raise
    _invalidate_child_registries(module)

    def undo() -> None:
        with contextlib.suppress(Exception):
            remove_context_parallel(module, plan)
        _restore_parallel_state(module, subs, had_registry, had_forward, processors, had_config, module_config)
        _invalidate_child_registries(module)

    return undo


def _invalidate_child_registries(module: torch.nn.Module) -> None:
    # diffusers caches which submodules carry hooks (for cache_context); ours came and went.
    registry = module.__dict__.get("_diffusers_hook")
    if isinstance(registry, HookRegistry) and hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()


def _restore_parallel_state(
    module: torch.nn.Module,
    subs: list[torch.nn.Module],
    had_registry: list[Any],
    had_forward: list[bool],
    processors: list[Any],
    had_config: list[Any],
    module_config: Any,
) -> None:
    for m, registry, forward in zip(subs, had_registry, had_forward):
        current = m.__dict__.get("_diffusers_hook")
        # Registries diffusers made for its split hooks, empty again: gone, with the forward
        # attribute they set (the module's own forward is the class's again).
        if registry is _MISSING and isinstance(current, HookRegistry) and not current.hooks:
            del m.__dict__["_diffusers_hook"]
            if not forward:
                m.__dict__.pop("forward", None)
    for p, before in zip(processors, had_config):
        if p is None:
            continue
        if before is _MISSING:
            p.__dict__.pop("_parallel_config", None)
        else:
            p.__dict__["_parallel_config"] = before
    if module_config is _MISSING:
        module.__dict__.pop("_parallel_config", None)
    else:
        module.__dict__["_parallel_config"] = module_config


def agree_on_capture(
    agreement: Agreement,
    group: Any,
    runner: GraphRunner,
    name: str,
    keys: set[Hashable],
    blocked: set[Hashable],
) -> None:
    """After a call of denoiser ``name`` that captured (or failed to) on this Ulysses group
    (``group``, its gloo twin): all keep its new graphs or none. ``keys`` and ``blocked``: the
    runner's before the call."""
    new = [k for k in runner.keys if k not in keys]
    failed = [k for k in runner.blocked if k not in blocked]
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    agreement.collective(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group), "agreeing on a capture")
    if not int(flag.item()):
        return
    if new:
        runner.block(
            new,
            "another rank failed to capture this call; every rank runs it eagerly (collectives in step)",
        )
    logger.warning(
        "%s: a capture failed on %s; every rank of its Ulysses group runs that call eagerly",
        name,
        "this rank" if failed else "another rank",
    )
