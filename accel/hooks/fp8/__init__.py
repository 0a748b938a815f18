"""Float8: ``quantize="fp8"``, its backends and which layers it may take.

Owns the quantizers (torchao's float8 and the library's own ``torch._scaled_mm`` path), the
per-layer selection measured on a calibration call under ``fp8_budget``, and the quantization an
installation applies at its first warm-up.

The modules: ``quantizers`` (what ``quantize=`` does to one Linear layer, and what it refuses),
``row_quant`` and ``row_quant_kernel`` (activations quantized per row in one pass, after a GELU
or a SwiGLU's product where asked),
``norm_quant`` and ``norm_quant_kernel`` (a modulated LayerNorm that writes its float8 rows),
``scaled_mm`` (float8 Linear layers through one opaque op), ``layer_kinds`` (which kind a model
gets), ``attention_layers`` (float8 attention as layers of the selection), ``layer_select`` (the
layers measured on one call, within the budget) and ``quantize`` (the installation's quantization).

May import: :mod:`accel.graphs` and the base modules (``options``, ``components``); nothing of
the other subpackages.
"""

from . import layer_kinds, quantizers, row_quant
from .row_quant import quantize_rows_e4m3, quantize_rows_reference, quantize_silu_mul_rows_e4m3
from .scaled_mm import ScaledMMFloat8, quantize_rows

__all__ = [
    "ScaledMMFloat8",
    "layer_kinds",
    "quantize_rows",
    "quantize_rows_e4m3",
    "quantize_rows_reference",
    "quantize_silu_mul_rows_e4m3",
    "quantizers",
    "row_quant",
]
