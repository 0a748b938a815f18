"""FlashAttention-3's forward from the ``fa3-fwd`` wheel, as diffusers' attention backends call it.

The wheel (``pip install 'bcg-diffusers[fa3]'``) ships one module, ``fa3_fwd_interface``, whose
``_flash_attn_forward`` is a custom op with a fake (dynamo, inductor and CUDA graphs take it as
one call) on ``(batch, tokens, heads, head dim)`` tensors, bf16 or float8_e4m3fn. Two functions
here have diffusers' backend signature (``query``, ``key``, ``value``, ``attn_mask``, ``scale``,
``is_causal``):

* :func:`fa3_attention`: bf16 in, bf16 out. Exact attention on other kernels than cuDNN's:
  lossless, not cuDNN's bits (the softmax's sums run in another order).
* :func:`fa3_fp8_attention`: queries, keys and values quantized to float8 with one scale per
  (sample, head), each head's largest magnitude at 448, and the scales handed to the kernel as
  its descales. Keys are smoothed first (their mean over tokens subtracted, as SageAttention
  does): a query's scores then all move by the same amount, which the softmax ignores, so the
  result is the same function with far smaller keys to round. Lossy, so only where
  ``quantize="fp8"``'s measured budget allows (:mod:`accel.hooks.fp8.attention_select`).

**Masks.** A key-padding mask (boolean, ``(batch, keys)`` or broadcast as ``(batch, 1, 1, keys)``:
what Qwen-Image's padded text and Z-Image's unequal captions make) is taken in FA3's "seqused"
form: each sample's kept keys are moved to the front, in order (attention does not depend on the
order of its keys), and the kernel reads only that many (``seqused_k``). Everything stays on the
device: no host sync, so a padded call is captured like any other. A mask of another kind (per
query, additive) runs diffusers' native attention instead, as does a dtype or head size the kernel
lacks: one warning line each, never a wrong result.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "E4M3_MAX",
    "FA3_EXTRA",
    "FA3_MODULE",
    "compact_keys",
    "fa3_attention",
    "fa3_fp8_attention",
    "key_padding",
    "load_fa3",
    "quantize_heads",
    "why_not_fa3",
]

logger = logging.getLogger(__name__)

FA3_MODULE = "fa3_fwd_interface"
FA3_EXTRA = "pip install 'bcg-diffusers[fa3]'"
E4M3_MAX = 448.0
# FlashAttention-3's kernels are Hopper's (compute capability 9.x).
HOPPER = 9
# What the wheel's kernels take: bf16 (its float16 kernels are left out) or float8, head sizes
# up to 256 in steps of 8.
_DTYPES = (torch.bfloat16,)
_MAX_HEAD_DIM = 256
# Devices the kernel runs on (tests put the CPU here beside a stand-in module).
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# A head of zeros keeps a finite scale.
_SCALE_FLOOR = 1e-12


# The wheel's module once loaded: the backends read it from here, as dynamo cannot trace an import.
_loaded: ModuleType | None = None


def load_fa3() -> ModuleType:
    """The wheel's module (ImportError, naming the extra, where it is not installed)."""
    global _loaded
    try:
        module = importlib.import_module(FA3_MODULE)
    except ImportError as e:
        raise ImportError(f"FlashAttention-3 needs the fa3-fwd wheel ({FA3_MODULE}: {e}): {FA3_EXTRA}") from None
    _loaded = module
    return module


def why_not_fa3(device: torch.device) -> str | None:
    """Why FlashAttention-3 cannot run for a model on ``device``, in one phrase; None where it can."""
    if importlib.util.find_spec(FA3_MODULE) is None:
        return f"the fa3-fwd wheel is not installed ({FA3_EXTRA})"
    if device.type not in DEVICE_TYPES:
        return f"it needs a CUDA GPU of compute capability 9.x (Hopper); the denoiser is on {device}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "it needs a CUDA GPU of compute capability 9.x (Hopper); CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if major != HOPPER:
            name = torch.cuda.get_device_name(device)
            return f"its kernels are Hopper's (compute capability 9.x); {device} ({name}) has {major}.{minor}"
    try:
        load_fa3()
    except Exception as e:  # a wheel built for another torch or CUDA fails here, in its own words
        return f"the fa3-fwd wheel does not load: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


# -- masks -------------------------------------------------------------------------------------


def key_padding(mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    """``mask`` as a ``(batch, keys)`` boolean key-padding mask where it is one (True: attended),
    else None (the caller falls back). A mask of every query alike, broadcast over heads."""
    if mask is None or mask.dtype != torch.bool or mask.shape[-1] != keys:
        return None
    if mask.dim() == 2:
        flat = mask
    elif mask.dim() in (3, 4) and all(s == 1 for s in mask.shape[1:-1]):
        flat = mask.reshape(mask.shape[0], keys)
    else:
        return None
    if flat.shape[0] not in (1, batch):
        return None
    return flat.expand(batch, keys)


def compact_keys(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's attended keys and values moved to the front, in order, and how many there
    are (int32, ``(batch,)``): FA3's ``seqused_k`` form of a ``(batch, keys)`` key-padding mask.
    Device work only (no host sync)."""
    batch, keys = mask.shape
    used = mask.sum(dim=-1, dtype=torch.int32)
    kept = mask.cumsum(dim=-1) - 1
    dropped = (~mask).cumsum(dim=-1) - 1 + used[:, None]
    destination = torch.where(mask, kept, dropped)
    source = torch.arange(keys, device=mask.device).expand(batch, keys)
    order = torch.empty_like(destination).scatter_(1, destination, source)
    index = order[:, :, None, None].expand(-1, -1, key.shape[2], key.shape[3])
    return key.gather(1, index), value.gather(1, index.expand(-1, -1, value.shape[2], value.shape[3])), used


# -- quantization ------------------------------------------------------------------------------


def quantize_heads(x: torch.Tensor, *, smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (batch, tokens, heads, dim) as float8 e4m3 with one float32 scale per (sample,
    head), ``(batch, heads)``: each head's largest magnitude becomes 448. ``smooth``: the head's
    mean over tokens is subtracted first (keys: see the module docstring)."""
    x = x.float()
    if smooth:
        x = x - x.mean(dim=1, keepdim=True)
    scale = (x.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(_SCALE_FLOOR)
    q = (x / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q, scale


# -- the backends ------------------------------------------------------------------------------

_said: set[str] = set()


def _fallback(why: str, native: Callable[..., torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """diffusers' native attention, said once per reason (not while dynamo traces: a compiled
    block says it in the eager call before)."""
    if why not in _said and not torch.compiler.is_compiling():
        _said.add(why)
        logger.warning("FlashAttention-3 does not take %s: that attention runs diffusers' native attention", why)
    return native(**kwargs)


def _native() -> Callable[..., torch.Tensor]:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]


def _unsupported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtypes: tuple[torch.dtype, ...]
) -> str | None:
    if query.device.type not in (*DEVICE_TYPES, "meta"):
        return f"tensors on {query.device.type}"
    if query.dtype not in dtypes or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"{str(query.dtype).removeprefix('torch.')} attention (it takes bf16)"
    head = query.shape[-1]
    if head > _MAX_HEAD_DIM or head % 8 or value.shape[-1] != head or query.dim() != 4:
        return f"a head size of {head}"
    if query.shape[2] % key.shape[2]:
        return "query heads that are not a multiple of the key heads"
    return None


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    dtypes: tuple[torch.dtype, ...],
) -> tuple[str | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(why it must fall back or None, keys, values, seqused_k)."""
    why = _unsupported(query, key, value, dtypes)
    if why is None and attn_mask is not None:
        padding = key_padding(attn_mask, query.shape[0], key.shape[1])
        if padding is None:
            shape = "x".join(map(str, attn_mask.shape))
            why = f"a {str(attn_mask.dtype).removeprefix('torch.')} mask of shape {shape} (only key-padding masks)"
        elif is_causal:
            why = "a mask with is_causal"
        else:
            key, value, used = compact_keys(key, value, padding)
            return None, key, value, used
    return why, key, value, None


def _call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    used: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    if query.device.type == "meta":  # shapes only (a probe of what the backend takes)
        return torch.empty(query.shape[:-1] + value.shape[-1:], dtype=torch.bfloat16, device="meta")
    fa3 = _loaded if _loaded is not None else load_fa3()
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    q_descale, k_descale, v_descale = descales if descales is not None else (None, None, None)
    out, *_ = fa3._flash_attn_forward(
        query,
        key,
        value,
        seqused_k=used,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        softmax_scale=softmax_scale,
        causal=is_causal,
        num_splits=1,
    )
    return out


def fa3_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    *,
    fp8: bool = False,
) -> torch.Tensor:
    """diffusers' attention backend signature: FlashAttention-3 in bf16, or with ``fp8`` on float8
    queries, keys and values with per-head scales, keys smoothed (see the module docstring); bf16 out."""
    why, key_c, value_c, used = _prepare(query, key, value, attn_mask, scale, is_causal, _DTYPES)
    if why is not None:
        return _fallback(
            why, _native(), query=query, key=key, value=value, attn_mask=attn_mask, scale=scale, is_causal=is_causal
        )
    if not fp8:
        return _call(query, key_c, value_c, used, scale, is_causal)
    q8, q_scale = quantize_heads(query)
    k8, k_scale = quantize_heads(key_c, smooth=True)
    v8, v_scale = quantize_heads(value_c)
    heads_k = key.shape[2]
    group = query.shape[2] // heads_k
    # The kernel takes one query descale per key head: grouped queries share their group's largest.
    if group > 1:
        q_scale_k = q_scale.unflatten(1, (heads_k, group)).amax(dim=2)
        q8 = (query.float() / q_scale_k.repeat_interleave(group, dim=1)[:, None, :, None]).to(torch.float8_e4m3fn)
        q_scale = q_scale_k
    out = _call(q8, k8, v8, used, scale, is_causal, (q_scale, k_scale, v_scale))
    return out.to(query.dtype)


# The float8 backend: diffusers calls a backend with the attention's own arguments only.
fa3_fp8_attention: Callable[..., torch.Tensor] = functools.partial(fa3_attention, fp8=True)
