"""float8 Linear layers through one opaque op: the alternative to torchao's tensor subclass.

torchao's float8 weights are a tensor subclass whose matrix product dynamo and inductor trace
through (quantizing the activations, then ``torch._scaled_mm``). Its per-row path has been
reported not to be safe under CUDA graphs on another stack (cache-dit wrapped the product in an
opaque op). :class:`ScaledMMFloat8` is that design: each layer becomes a
:class:`Float8RowwiseLinear`, which quantizes its input per row with plain tensor ops (inductor
fuses them) and calls :func:`scaled_mm_rowwise`, a custom op that dynamo and inductor see as one
call to ``torch._scaled_mm``, whatever torchao does. It needs no torchao. Numerically it is the
same recipe as torchao's (e4m3, per-row scales of the activations and of the weights, fast
accumulation): the GPU tests and ``scripts/bench_fp8.py`` run both, so one run tells which path
graphs and compile take.

``quantize="fp8"`` makes these layers where the recipe names them (``Recipe.fp8_layers``,
:mod:`accel.hooks.fp8.layer_kinds`: Qwen-Image), torchao's elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .quantizers import Quantizer, check_bf16_weights, check_fp8_device
from .row_quant import E4M3_MAX, quantize_rows_e4m3, quantize_silu_mul_rows_e4m3
from .row_quant import quantize_rows_reference as quantize_rows

__all__ = [
    "E4M3_MAX",
    "Float8RowwiseLinear",
    "PendingRows",
    "ScaledMMFloat8",
    "quantize_rows",
    "scaled_mm_rowwise",
    "scaled_mm_rowwise_behind",
]


@torch.library.custom_op("bcg_diffusers::scaled_mm_rowwise", mutates_args=())
def scaled_mm_rowwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` in ``out_dtype``: ``a`` row-major (M, K) float8,
    ``b`` column-major (K, N) float8, ``scale_a`` (M, 1) and ``scale_b`` (1, N) float32."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=True)


@scaled_mm_rowwise.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("bcg_diffusers::scaled_mm_rowwise_behind", mutates_args=())
def scaled_mm_rowwise_behind(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    prefix: torch.Tensor,
) -> torch.Tensor:
    """``torch.cat([prefix, scaled_mm_rowwise(a, b, ...)])`` with the product written in place
    behind the copied ``prefix`` (P, N), in its dtype: a cached prefix's values and a step's
    without the concatenation's second pass over the step's rows. The same product, the same
    kernel (the rows behind the prefix keep the output's alignment where N is a multiple of 128)."""
    p = prefix.shape[0]
    out = torch.empty((p + a.shape[0], b.shape[1]), dtype=prefix.dtype, device=a.device)
    out[:p].copy_(prefix)
    torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=prefix.dtype, use_fast_accum=True, out=out[p:]
    )
    return out


@scaled_mm_rowwise_behind.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    prefix: torch.Tensor,
) -> torch.Tensor:
    return prefix.new_empty((prefix.shape[0] + a.shape[0], b.shape[1]))


class PendingRows:
    """An input its producer quantizes itself, handed to a :class:`Float8RowwiseLinear` in place of
    the activation (a modulated LayerNorm that writes its float8 rows in one pass: Qwen-Image 2.1's
    compiled form). A subclass holds what the producer needs and returns the rows."""

    def e4m3_rows(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The activation as e4m3 rows, their float32 scales (rows, 1) and the activation's
        leading shape."""
        raise NotImplementedError


class Float8RowwiseLinear(torch.nn.Module):
    """A Linear layer with float8 weights (per output row) that quantizes its input per row and
    multiplies through :func:`scaled_mm_rowwise`.

    Attributes:
        qweight: (out, in) e4m3 weights, row-major.
        weight_scale: (1, out) float32 scales.
        bias: the original layer's bias (the same parameter), or None.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._dtype = linear.weight.dtype
        with torch.no_grad():
            q, scale = quantize_rows(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("weight_scale", scale.reshape(1, -1))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight's shape and dtype, without data (a meta tensor), for model code that reads
        them (Z-Image's timestep embedder casts to its first layer's dtype)."""
        return torch.empty(self.out_features, self.in_features, dtype=self._dtype, device="meta")

    def forward(self, x: torch.Tensor | PendingRows) -> torch.Tensor:
        if isinstance(x, PendingRows):
            return self.forward_quantized(*x.e4m3_rows())
        return self._product(x, gelu_tanh=False)

    def forward_after_gelu_tanh(self, pre: torch.Tensor) -> torch.Tensor:
        """``self(gelu(pre, approximate="tanh"))``, with the GELU computed inside the input's
        quantization instead of written out (a feed-forward's down projection; see
        :mod:`accel.hooks.compiled.fused`)."""
        return self._product(pre, gelu_tanh=True)

    def forward_after_silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)``, with the SiLU and the product computed inside the input's
        quantization instead of written out (a SwiGLU feed-forward's down projection; see
        :func:`~accel.hooks.fp8.row_quant.quantize_silu_mul_rows_e4m3`)."""
        xq, xs = quantize_silu_mul_rows_e4m3(gate.reshape(-1, self.in_features), up.reshape(-1, self.in_features))
        return self.forward_quantized(xq, xs, tuple(gate.shape[:-1]))

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """The product of an input quantized already (rows of e4m3 values and their float32 scales,
        as :func:`~accel.hooks.fp8.row_quant.quantize_rows_e4m3` makes them, written by the kernel
        that produced the input; see :mod:`accel.hooks.fp8.norm_quant`), shaped ``(*lead, out)``."""
        out = scaled_mm_rowwise(xq, self.qweight.t(), xs, self.weight_scale, self.bias, self._dtype)
        return out.reshape(*lead, self.out_features)

    def forward_behind(self, x: torch.Tensor | PendingRows, prefix: torch.Tensor) -> torch.Tensor:
        """``torch.cat([prefix, self(x)], dim=1)``: ``prefix`` (batch, P, out). At batch 1, in the
        product's dtype, the product is written behind the copied prefix
        (:func:`scaled_mm_rowwise_behind`); anything else concatenates."""

        def one_row(lead: tuple[int, ...], dtype: torch.dtype) -> bool:
            return len(lead) == 2 and lead[0] == 1 and prefix.shape[0] == 1 and prefix.dtype == dtype

        if isinstance(x, PendingRows):
            xq, xs, lead = x.e4m3_rows()
            if not one_row(lead, self._dtype):
                return torch.cat([prefix, self.forward_quantized(xq, xs, lead)], dim=1)
        elif not one_row(tuple(x.shape[:-1]), x.dtype):
            return torch.cat([prefix, self(x)], dim=1)
        else:
            xq, xs = quantize_rows_e4m3(x.reshape(-1, self.in_features), False)
        out = scaled_mm_rowwise_behind(xq, self.qweight.t(), xs, self.weight_scale, self.bias, prefix[0])
        return out.unsqueeze(0)

    def _product(self, x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, xs = quantize_rows_e4m3(x2, gelu_tanh)
        out = scaled_mm_rowwise(xq, self.qweight.t(), xs, self.weight_scale, self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"


class ScaledMMFloat8(Quantizer):
    """Each layer replaced by a :class:`Float8RowwiseLinear` (see the module docstring)."""

    name = "scaled_mm float8"
    detail = "dynamic float8 activations and float8 weights, per-row scales, one custom op per product"

    def check(self, module: torch.nn.Module | None, device: torch.device) -> None:
        check_fp8_device(device)
        check_bf16_weights(module)

    def takes(self, linear: torch.nn.Linear) -> bool:
        return (
            type(linear.weight) is torch.nn.Parameter
            and linear.weight.dtype == torch.bfloat16
            and linear.in_features % 16 == 0
            and linear.out_features % 16 == 0
        )

    def quantize(self, root: torch.nn.Module, names: Sequence[str]) -> list[str]:
        done = []
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name)
            linear = parent._modules[attr]
            if isinstance(linear, torch.nn.Linear) and self.takes(linear):
                parent._modules[attr] = Float8RowwiseLinear(linear)
                done.append(name)
        return done

    def is_quantized(self, module: torch.nn.Module) -> bool:
        return isinstance(module, Float8RowwiseLinear)
