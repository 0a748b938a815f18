"""Which kind of float8 layer ``quantize="fp8"`` makes for a model: :func:`quantizer_for`.

Two kinds, the same numbers (e4m3, per-row scales of activations and weights, fast accumulation):
torchao's tensor subclass (:class:`~accel.hooks.fp8.quantizers.TorchAOFloat8`, the default), or
the library's own layers (:class:`~accel.hooks.fp8.scaled_mm.ScaledMMFloat8`), one opaque product
each, whose activations are quantized in one pass (:mod:`accel.hooks.fp8.row_quant`). Which is
faster depends on what produces a layer's input, so a recipe names the kind its model measured
fastest with (``Recipe.fp8_layers``).
"""

from __future__ import annotations

from collections.abc import Callable

from .quantizers import QUANTIZERS, Quantizer, TorchAOFloat8
from .scaled_mm import ScaledMMFloat8

__all__ = ["FP8_LAYERS", "quantizer_for"]

# The kinds a recipe may name. Tests put a stand-in here (and in QUANTIZERS).
FP8_LAYERS: dict[str, Callable[[], Quantizer]] = {"torchao": TorchAOFloat8, "scaled-mm": ScaledMMFloat8}


def quantizer_for(value: str, layers: str | None = None) -> Quantizer:
    """A fresh quantizer for a ``quantize=`` value (validated by the options already), of the
    kind of float8 layer ``layers`` names (a :data:`FP8_LAYERS` key; None: the value's own)."""
    if layers is None:
        return QUANTIZERS[value]()
    if layers not in FP8_LAYERS:
        raise ValueError(f"float8 layers must be one of {', '.join(FP8_LAYERS)}; got {layers!r}")
    return FP8_LAYERS[layers]()
