"""A stand-in for the ``fa3-fwd`` wheel's ``fa3_fwd_interface``, for the CPU.

The wheel cannot be installed here (its kernels are CUDA 13 and Hopper's). :func:`use_fake_fa3`
puts a module of that name into ``sys.modules`` whose ``_flash_attn_forward`` has the wheel's
signature, word for word (an argument the library passes that the wheel does not name fails here
as it would there), and computes what the kernel computes: softmax attention in float32 over the
first ``seqused_k`` keys of each sample, float8 inputs multiplied by their per-(sample, head)
descales, a bf16 output for float8 inputs. It is a custom op with a fake, as the wheel's is, so
dynamo traces the library's backends through it. Every call is counted (``calls``).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from accel.hooks.attention import fa3

calls: list[dict[str, object]] = []


def _descaled(x: torch.Tensor, descale: torch.Tensor | None, heads: int) -> torch.Tensor:
    x = x.float()
    if descale is not None:
        group = heads // descale.shape[1]
        x = x * descale.repeat_interleave(group, dim=1)[:, None, :, None]
    return x


@torch.library.custom_op("bcg_test_fa3::flash_attn_forward", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqused_k: torch.Tensor | None,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    heads = q.shape[2]
    group = heads // k.shape[2]
    qf = _descaled(q, q_descale, heads)
    kf = _descaled(k, k_descale, k.shape[2]).repeat_interleave(group, dim=2)
    vf = _descaled(v, v_descale, v.shape[2]).repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    keys = torch.arange(k.shape[1])
    if seqused_k is not None:
        scores = scores.masked_fill(keys[None, None, None, :] >= seqused_k[:, None, None, None], -math.inf)
    if causal:
        offset = k.shape[1] - q.shape[1]
        scores = scores.masked_fill(keys[None, :] > torch.arange(q.shape[1])[:, None] + offset, -math.inf)
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), vf)
    dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    return out.to(dtype), lse


@_forward.register_fake
def _(q, k, v, seqused_k, q_descale, k_descale, v_descale, softmax_scale, causal):  # type: ignore[no-untyped-def]
    dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=dtype)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _flash_attn_forward(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    qv=None,
    out_=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):  # type: ignore[no-untyped-def]
    """The wheel's signature (fa3-fwd 0.0.3); what the library does not use must stay unset."""
    unused = (k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, page_table)
    assert all(x is None for x in unused) and max_seqlen_q is None and max_seqlen_k is None
    assert softmax_scale is not None and num_splits == 1 and softcap == 0.0
    if not torch.compiler.is_compiling():
        calls.append({"dtype": q.dtype, "shape": tuple(q.shape), "seqused_k": seqused_k is not None})
    out, lse = _forward(q, k, v, seqused_k, q_descale, k_descale, v_descale, softmax_scale, causal)
    return out, lse, q.new_empty(0), q.new_empty(0)


def use_fake_fa3(monkeypatch: pytest.MonkeyPatch, *, cpu: bool = True) -> types.ModuleType:
    """``fa3_fwd_interface`` is the stand-in (and, ``cpu``, FlashAttention-3 runs on the CPU)."""
    module = types.ModuleType(fa3.FA3_MODULE)
    module._flash_attn_forward = _flash_attn_forward  # type: ignore[attr-defined]
    module.__spec__ = importlib_spec(fa3.FA3_MODULE)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, fa3.FA3_MODULE, module)
    monkeypatch.setattr(fa3, "_loaded", module)
    if cpu:
        monkeypatch.setattr(fa3, "DEVICE_TYPES", ("cuda", "cpu"))
    calls.clear()
    return module


def importlib_spec(name: str):  # type: ignore[no-untyped-def]
    import importlib.machinery

    return importlib.machinery.ModuleSpec(name, loader=None)
