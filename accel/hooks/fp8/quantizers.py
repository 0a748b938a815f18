"""What ``quantize=`` does to one Linear layer, and what it refuses.

A :class:`Quantizer` turns named Linear layers of a model into quantized ones in place (torchao
swaps a layer's weight for a float8 tensor subclass; another quantizer may replace the module),
says which layers it can take, and refuses a device or a model it cannot run on in one line
(:class:`QuantizeError`). :data:`QUANTIZERS` maps each ``quantize=`` value to its quantizer. The
layer selection (:mod:`accel.hooks.fp8.layer_select`) is written against this interface only, so a
stand-in with an error of its own tests it on the CPU bit for bit, and the real quantizer runs
the same code.

Also here: whether a model's weights are quantized already (through diffusers'
``TorchAoConfig`` when it was loaded, or by an earlier ``quantize=``), and how many bytes they
take.
"""

from __future__ import annotations

import abc
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "FP8_EXTRA",
    "MIN_FP8_CAPABILITY",
    "QUANTIZERS",
    "TORCHAO_VERSIONS",
    "QuantizeError",
    "Quantizer",
    "TorchAOFloat8",
    "check_bf16_weights",
    "check_fp8_device",
    "check_quantize",
    "module_bytes",
    "quantized_when_loaded",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

FP8_EXTRA = "pip install 'bcg-diffusers[fp8]'"
# The torchao range quantize="fp8" was tested with (the [fp8] extra pins the same).
TORCHAO_VERSIONS = ">=0.17,<0.19"
# float8 matrix products (torch._scaled_mm) need Ada (8.9), Hopper (9.0) or newer.
MIN_FP8_CAPABILITY = (8, 9)
# A row of zeros would get a zero scale and turn into NaN (0 / 0): scales never go below this.
ZERO_ROW_FLOOR = 1e-12


class QuantizeError(ValueError):
    """``quantize=`` cannot run here; the message is one line and says what would make it run."""


class Quantizer(abc.ABC):
    """Quantizes named Linear layers of a model in place.

    Attributes:
        name: what the report calls it (``"torchao float8"``).
        detail: how it quantizes, in a few words, for the report.
    """

    name: str = "quantizer"
    detail: str = ""

    def check(self, module: torch.nn.Module | None, device: torch.device) -> None:  # noqa: B027 (optional)
        """QuantizeError, in one line, where ``module`` on ``device`` cannot be quantized (None:
        any model, checked before one is built)."""

    def takes(self, linear: torch.nn.Linear) -> bool:
        """Whether :meth:`quantize` can take this layer (its shape, its dtype)."""
        return True

    @abc.abstractmethod
    def quantize(self, root: torch.nn.Module, names: Sequence[str]) -> list[str]:
        """Quantize the Linear layers of ``root`` at these qualified names, in place; returns the
        names quantized (those it took). A layer may be changed in place or replaced in its parent."""

    def is_quantized(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is a layer this quantizer made."""
        return False


def check_fp8_device(device: torch.device, what: str = "the denoiser") -> None:
    """QuantizeError unless ``device`` is a CUDA GPU that runs float8 products (8.9 or newer)."""
    need = f"quantize='fp8' needs a CUDA GPU of compute capability {'.'.join(map(str, MIN_FP8_CAPABILITY))} or newer"
    if device.type != "cuda" or not torch.cuda.is_available():
        raise QuantizeError(f"{need} (Ada, Hopper, Blackwell); {what} is on {device}")
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise QuantizeError(f"{need}; {device} ({name}) has compute capability {capability[0]}.{capability[1]}")


def _weights_dtype(module: torch.nn.Module) -> torch.dtype | None:
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            return m.weight.dtype
    return None


def check_bf16_weights(module: torch.nn.Module | None) -> None:
    """QuantizeError unless ``module``'s Linear weights are bf16 (None: no model yet, nothing to check)."""
    dtype = _weights_dtype(module) if module is not None else None
    if dtype is not None and dtype != torch.bfloat16:
        raise QuantizeError(
            f"quantize='fp8' (per-row float8) needs bfloat16 weights; {type(module).__name__}'s are "
            f"{str(dtype).removeprefix('torch.')}: load it with torch_dtype=torch.bfloat16"
        )


def _torchao_version() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class TorchAOFloat8(Quantizer):
    """torchao's float8 inference: ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
    through ``quantize_`` with a filter on the names.

    Two settings differ from torchao's defaults: ``set_inductor_config=False`` (torchao would
    change inductor's settings for the whole process; the library compiles with inductor's
    defaults) and a floor on the activations' scales (:data:`ZERO_ROW_FLOOR`: a row of zeros, a
    padded token, comes out as the bias instead of NaN). Layers whose sizes are not multiples of
    16, which ``torch._scaled_mm`` cannot take, stay as they are (torchao would skip them silently).
    """

    name = "torchao float8"
    detail = "dynamic float8 activations and float8 weights, per-row scales"

    def check(self, module: torch.nn.Module | None, device: torch.device) -> None:
        check_fp8_device(device)
        version = _torchao_version()
        if version is None:
            raise QuantizeError(f"quantize='fp8' needs torchao: {FP8_EXTRA}")
        try:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_  # noqa: F401
        except ImportError as e:
            raise QuantizeError(
                f"quantize='fp8' needs torchao {TORCHAO_VERSIONS} (this is {version}: {e}): {FP8_EXTRA}"
            ) from None
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            tested = Version(version) in SpecifierSet(TORCHAO_VERSIONS)
        except InvalidVersion:
            tested = False
        if not tested:
            logger.warning("quantize='fp8' was tested with torchao %s; this is %s", TORCHAO_VERSIONS, version)
        check_bf16_weights(module)

    def takes(self, linear: torch.nn.Linear) -> bool:
        weight = linear.weight
        return (
            type(weight) is torch.nn.Parameter
            and weight.dtype == torch.bfloat16
            and linear.in_features % 16 == 0
            and linear.out_features % 16 == 0
        )

    def config(self) -> Any:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), set_inductor_config=False, activation_value_lb=ZERO_ROW_FLOOR
        )

    def quantize(self, root: torch.nn.Module, names: Sequence[str]) -> list[str]:
        from torchao.quantization import quantize_

        wanted = set(names)
        quantize_(root, self.config(), filter_fn=lambda m, fqn: fqn in wanted and isinstance(m, torch.nn.Linear))
        modules = dict(root.named_modules())
        return [n for n in names if self.is_quantized(modules[n])]

    def is_quantized(self, module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return isinstance(weight, torch.Tensor) and _is_torchao(weight)


def _is_torchao(t: torch.Tensor) -> bool:
    # Without importing torchao: no tensor is one of its subclasses before it was imported.
    return type(t).__module__.split(".")[0] == "torchao"


# quantize= value -> its quantizer where the recipe names no kind of float8 layer
# (accel.hooks.fp8.layer_kinds). Tests put a stand-in here (and there).
QUANTIZERS: dict[str, Callable[[], Quantizer]] = {"fp8": TorchAOFloat8}


def check_quantize(value: str, device: torch.device) -> None:
    """QuantizeError, in one line, where ``quantize=value`` cannot run on ``device``, checked
    before a model exists (the device, torchao); ValueError for a value that is none."""
    if value not in QUANTIZERS:
        raise ValueError(f"quantize must be None or one of {', '.join(QUANTIZERS)}; got {value!r}")
    QUANTIZERS[value]().check(None, torch.device(device))


def quantized_when_loaded(module: torch.nn.Module) -> str | None:
    """How ``module``'s weights are quantized already, as a phrase (``"quantized when loaded
    (torchao, 37 layers with torchao weights)"``): through diffusers' quantization config when
    it was loaded, or torchao tensors put in since; None for none."""
    hf = getattr(module, "hf_quantizer", None)
    method = getattr(getattr(hf, "quantization_config", None), "quant_method", None)
    layers = sum(1 for m in module.modules() if any(_is_torchao(p) for p in m._parameters.values() if p is not None))
    torchao = f", {layers} layers with torchao weights" if layers else ""
    if method is not None:
        return f"quantized when loaded ({getattr(method, 'value', method)}{torchao})"
    return f"quantized already (torchao{torchao})" if layers else None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements; a tensor subclass's (torchao's) are its inner tensors'."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each counted once."""
    seen: dict[int, int] = {}
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and id(t) not in seen:
                seen[id(t)] = tensor_bytes(t)
    return sum(seen.values())
