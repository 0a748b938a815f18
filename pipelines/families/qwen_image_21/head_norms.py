"""Qwen-Image 2.1's query and key head norms and rotation as one op each (``compile=True``).

diffusers' ``_qwenimage21_prepare_qkv`` normalises the queries' and keys' heads (``RMSNorm``),
rotates them (the complex rotary product) and, at the steps that read the prefix K/V cache,
concatenates the cached keys in front of the step's. Compiled, those are reduction kernels that
read and write each tensor about three times over, and a copy of the keys behind the prefix.
Under this form both go through :func:`accel.head_norm_rope`: one pass each, the keys written
straight behind the copied prefix. Everything else is diffusers 0.42's function, in its order
(the recipe pins that range).

On by default (``QwenImage21Recipe.fused_head_norms``): on an H100 the float8 call with it is
faster in the same process, its graphs equal to the same model without them (docs/benchmarks.md).

With ``values_behind`` (``QwenImage21Recipe.values_behind_prefix``), at the steps that read the
cache the library's float8 value projection writes its product straight behind the copied cached
values (batch 1; :func:`accel.hooks.fp8.scaled_mm.scaled_mm_rowwise_behind`) instead of the
concatenation's pass over the step's values: the same product, the same kernel (on by default:
on an H100 the float8 call is faster with it in the same process, docs/benchmarks.md).

Decided at each call: only where both norms are diffusers' ``RMSNorm`` with a weight and no
forward of their own, and the rotation is the complex table the model passes; anything else runs
diffusers' function. On the CPU the op is the modules' arithmetic, bit for bit
(tests/pipelines/families/test_qwen_image_21_head_norms.py); on CUDA within a bf16 unit of it now
and then (tests/cuda/test_head_norm.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.normalization import RMSNorm

from accel import head_norm_rope, patch, unpatched

from .fused_norms import library_float8
from .layout import MODULE

__all__ = ["fuse_head_norms"]

WHY = "qwen-image-2.1: the query and key head norms and their rotation in one pass (compile=True)"


def _fusable(attn: torch.nn.Module, rotary_emb: Any) -> bool:
    norms = (getattr(attn, "norm_q", None), getattr(attn, "norm_k", None))
    return (
        isinstance(rotary_emb, torch.Tensor)
        and rotary_emb.is_complex()
        and all(
            type(n) is RMSNorm
            and "forward" not in vars(n)
            and n.weight is not None
            and getattr(n, "bias", None) is None
            for n in norms
        )
    )


def _prepare_qkv(stock: Callable[..., Any], values_behind: bool) -> Callable[..., Any]:
    def prepare_qkv(
        attn: torch.nn.Module,
        hidden_states: Any,
        rotary_emb: torch.Tensor | None,
        layer_cache: Any,
        kv_cache_mode: str | None,
        cache_write_slice: slice | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if not _fusable(attn, rotary_emb):
            return stock(attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice)
        # diffusers 0.42's _qwenimage21_prepare_qkv, the norms and rotation as head_norm_rope (and
        # with values_behind, a float8 value projection written behind the cached values).
        cached = layer_cache is not None and kv_cache_mode == "cached"
        cached_k, cached_v = layer_cache.get() if cached else (None, None)
        behind = cached and values_behind and library_float8(attn.to_v)
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v.forward_behind(hidden_states, cached_v.flatten(2)) if behind else attn.to_v(hidden_states)
        head_dim = attn.inner_dim // attn.heads
        query = query.unflatten(-1, (-1, head_dim))
        key = key.unflatten(-1, (-1, head_dim))
        value = value.unflatten(-1, (-1, head_dim))
        freqs = torch.view_as_real(rotary_emb)
        query = head_norm_rope(query, attn.norm_q.weight, attn.norm_q.eps, freqs)
        key = head_norm_rope(key, attn.norm_k.weight, attn.norm_k.eps, freqs, cached_k)
        if layer_cache is not None:
            if kv_cache_mode == "extract" and cache_write_slice is not None:
                layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
            elif cached and not behind:
                value = torch.cat([cached_v, value], dim=1)
        return query, key, value, query.shape[1]

    return prepare_qkv


def fuse_head_norms(values_behind: bool = False) -> Callable[[], None]:
    """Put this form (see the module docstring) in diffusers' Qwen-Image 2.1 module until the
    returned undo is called; with ``values_behind``, the library's float8 value projections write
    the step's values behind the cached ones (:meth:`~accel.Float8RowwiseLinear.forward_behind`).
    Call it before the blocks compile: dynamo traces what the function is then."""
    mod = sys.modules[MODULE]
    stock = unpatched(mod, "_qwenimage21_prepare_qkv")
    return patch(mod, "_qwenimage21_prepare_qkv", _prepare_qkv(stock, values_behind), why=WHY).undo
