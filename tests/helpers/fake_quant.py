"""A stand-in for the float8 quantizer, for the CPU: the selection's code with an error we choose.

:class:`GridQuantizer` replaces each Linear layer by a :class:`GridLinear`, which rounds its
weights (once) and its input (every call) per row to ``levels`` steps of the row's largest
magnitude, stores the weights as int8 (one byte per weight, as float8 would) and multiplies in
the input's dtype. Fewer levels, more error; ``coarse`` gives some layers fewer levels (the ones
a test wants measured worst). Deterministic on the CPU, so selections and reports repeat bit for
bit. ``refused`` names layers whose product raises as cuBLASLt's float8 product does on shapes
it does not support. ``use_grid(monkeypatch, ...)`` makes ``quantize="fp8"`` use it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import pytest
import torch
import torch.nn.functional as F

from accel.hooks.fp8 import layer_kinds, quantizers
from accel.hooks.fp8.quantizers import Quantizer


def _round_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / levels
    return torch.round(x.float() / scale), scale


class GridLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, levels: int, refused: bool = False) -> None:
        super().__init__()
        assert 1 <= levels <= 127
        self.levels = levels
        self.refused = refused
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._dtype = linear.weight.dtype
        with torch.no_grad():
            q, scale = _round_rows(linear.weight, levels)
        self.register_buffer("qweight", q.to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:  # shape and dtype only, as Float8RowwiseLinear's
        return torch.empty(self.out_features, self.in_features, dtype=self._dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.refused:
            raise RuntimeError(
                "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(...)`"
            )
        q, s = _round_rows(x, self.levels)
        w = (self.qweight.float() * self.scale).to(x.dtype)
        return F.linear((q * s).to(x.dtype), w, self.bias)


class GridQuantizer(Quantizer):
    name = "stand-in grid"
    detail = "weights and activations rounded per row"

    def __init__(
        self,
        levels: int = 32,
        coarse: Mapping[str, int] | None = None,
        refuse: str | None = None,
        refused: Sequence[str] = (),
    ) -> None:
        self.levels = levels
        self.refused = tuple(refused)
        self.coarse = dict(coarse or {})
        self.refuse = refuse
        self.calls: list[list[str]] = []

    def check(self, module: torch.nn.Module | None, device: torch.device) -> None:
        if self.refuse:
            raise quantizers.QuantizeError(self.refuse)

    def levels_for(self, name: str) -> int:
        return next((n for p, n in self.coarse.items() if fnmatch.fnmatchcase(name, p)), self.levels)

    def quantize(self, root: torch.nn.Module, names: Sequence[str]) -> list[str]:
        self.calls.append(list(names))
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name)
            refused = any(fnmatch.fnmatchcase(name, p) for p in self.refused)
            parent._modules[attr] = GridLinear(parent._modules[attr], self.levels_for(name), refused)
        return list(names)

    def is_quantized(self, module: torch.nn.Module) -> bool:
        return isinstance(module, GridLinear)


def use_grid(monkeypatch: pytest.MonkeyPatch, **kwargs) -> list[GridQuantizer]:
    """``quantize="fp8"`` makes a :class:`GridQuantizer` (``kwargs``); returns those made."""
    made: list[GridQuantizer] = []

    def make() -> GridQuantizer:
        made.append(GridQuantizer(**kwargs))
        return made[-1]

    monkeypatch.setitem(quantizers.QUANTIZERS, "fp8", make)
    # Whatever kind of float8 layer a recipe names.
    monkeypatch.setattr(layer_kinds, "FP8_LAYERS", dict.fromkeys(layer_kinds.FP8_LAYERS, make))
    return made


def torchao_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real torchao quantizer on the CPU: its device checks (and torchao's own) pass.

    torchao's float8 tensors compute on the CPU too (``torch._scaled_mm`` has a CPU kernel), so
    its path through the library runs here as it does on a GPU, slower and on other kernels.
    """
    pytest.importorskip("torchao")
    import torchao.quantization.quant_api as quant_api

    from accel.hooks.fp8 import scaled_mm

    for module in (quantizers, scaled_mm):
        monkeypatch.setattr(module, "check_fp8_device", lambda device, what="": None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setattr(quant_api, "is_sm_at_least_89", lambda: True)
