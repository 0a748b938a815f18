"""A residual stream's gated update in one pass: :func:`gated_residual`.

Single-stream DiTs with shared modulation (Qwen-Image 2.1) end each half of a block with
``hidden + tanh(gate) * out``, the gate one row per sample (or per sample at its target tokens and
a last row elsewhere) spread over the tokens. Compiled, inductor takes the tanh per token and
channel where there is one per row; on an H100 that kernel ran at about 90 us where its bytes take
about 33 (docs/benchmarks.md, Qwen-Image 2.1's float8 step with the library's layers).

:func:`gated_residual` is one custom op, opaque to dynamo and inductor: the gate's rows through
tanh (ATen's, a few thousand values), then on CUDA a Triton program per tile of tokens and channels
reads ``hidden`` and ``out`` once, picks each token's row and writes the sum. It rounds where the
tensor ops round (the tanh, the product, the sum), so on CUDA it gives their bits; elsewhere it is
:func:`gated_residual_reference`, those tensor ops. It takes bf16 only on the kernel, contiguous
``(batch, tokens, channels)`` with channels a multiple of 1024 or a power of two; anything else runs
the reference.

With ``tanh=False`` the gate's rows come already through tanh: a compiled caller takes it in its
graph, where inductor can make it with the block's other small kernels (one launch for both gates
of a block at most, where the op launches an ATen tanh per update).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gated_residual", "gated_residual_reference"]


def gated_residual_reference(
    hidden: torch.Tensor,
    out: torch.Tensor,
    gate: torch.Tensor,
    mask: torch.Tensor | None = None,
    tanh: bool = True,
) -> torch.Tensor:
    """``hidden + tanh(rows) * out``: ``hidden`` and ``out`` (batch, tokens, D); ``gate`` (batch, D)
    one row a sample, or with ``mask`` (tokens, bool) (batch + 1, D): a sample's own row where the
    mask is set, the last row elsewhere. ``tanh=False``: ``gate`` is already ``tanh(rows)``."""
    rows = gate.tanh() if tanh else gate
    if mask is None:
        spread = rows.unsqueeze(1)
    else:
        spread = torch.where(mask.view(1, -1, 1), rows[:-1].unsqueeze(1), rows[-1:].unsqueeze(0))
    return hidden + spread * out


def _check(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor | None) -> None:
    batch = hidden.shape[0] if hidden.dim() == 3 else -1
    ok = (
        hidden.dim() == 3
        and out.shape == hidden.shape
        and gate.shape == (batch + (mask is not None), hidden.shape[-1])
        and (mask is None or (mask.shape == (hidden.shape[1],) and mask.dtype == torch.bool))
    )
    if not ok:
        raise ValueError(
            "gated_residual takes hidden and out (batch, tokens, D), gate (batch, D) or with a mask "
            f"(batch + 1, D) and mask (tokens,) bool; got {tuple(hidden.shape)}, {tuple(out.shape)}, "
            f"{tuple(gate.shape)}, {None if mask is None else (tuple(mask.shape), mask.dtype)}"
        )


# Channels a program holds: 1024, or the whole row where it is a smaller power of two.
CHANNELS = 1024


def _channels(d: int) -> int | None:
    if d % CHANNELS == 0:
        return CHANNELS
    return d if d & (d - 1) == 0 else None


def _one_pass(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (
        hidden.is_cuda
        and hidden.dtype == out.dtype == gate.dtype == torch.bfloat16
        and hidden.is_contiguous()
        and out.is_contiguous()
        and gate.device == hidden.device
        and (mask is None or mask.device == hidden.device)
        and hidden.shape[-1] >= 16
        and _channels(hidden.shape[-1]) is not None
    )


@torch.library.custom_op("bcg_diffusers::gated_residual", mutates_args=())
def gated_residual(
    hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor | None = None, tanh: bool = True
) -> torch.Tensor:
    """:func:`gated_residual_reference` in one pass on CUDA (see the module docstring)."""
    _check(hidden, out, gate, mask)
    if not _one_pass(hidden, out, gate, mask):
        return gated_residual_reference(hidden, out, gate, mask, tanh)
    from .gated_residual_kernel import gated_residual_kernel

    with torch.cuda.device(hidden.device):
        return launch(gated_residual_kernel, hidden, out, gate, mask, tanh)


def launch(
    kernel: Any,
    hidden: torch.Tensor,
    out: torch.Tensor,
    gate: torch.Tensor,
    mask: torch.Tensor | None = None,
    tanh: bool = True,
) -> torch.Tensor:
    """Run ``kernel`` (:func:`~accel.hooks.compiled.gated_residual_kernel.gated_residual_kernel`, or
    the same function under Triton's interpreter) as the op does, on channels that tile."""
    import triton

    from .gated_residual_kernel import LAUNCH_OPTIONS, TOKENS

    batch, seq, d = hidden.shape
    channels = _channels(d)
    rows = (gate.tanh() if tanh else gate).contiguous()  # ATen's tanh, rounded as the tensor ops round it
    result = torch.empty_like(hidden)
    n = batch * seq
    if n:
        flags = rows if mask is None else mask.contiguous()  # any pointer where there is no mask
        kernel[(triton.cdiv(n, TOKENS), d // channels)](
            hidden,
            out,
            rows,
            flags,
            result,
            n,
            seq,
            batch,
            D=d,
            HAS_MASK=mask is not None,
            TOKENS=TOKENS,
            CHANNELS=channels,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return result


@gated_residual.register_fake
def _(
    hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor | None = None, tanh: bool = True
) -> torch.Tensor:
    return torch.empty_like(hidden)
