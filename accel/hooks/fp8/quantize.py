"""``quantize=``: the denoisers' Linear layers in float8, chosen by measurement at the first warm-up.

One :class:`Quantization` per accelerated pipeline (made by :func:`plan_quantization` when
:func:`accel.accelerate_pipeline` installs, before anything else is):

* **Refusals first**, each in one line (:class:`~accel.hooks.fp8.quantizers.QuantizeError`, a
  ValueError): a CPU, a GPU below compute capability 8.9 (the line names its capability), torchao
  missing (the line names the extra), weights that are not bf16, weights quantized when loaded by
  another library than torchao. An unknown value is refused by the options.
* **Nothing changes until the first** :meth:`~accel.hooks.accelerator.PipelineAccelerator.warmup`:
  the first call of its largest case with the guidance setting the calls will run (``measure_cfg``:
  guidance multiplies the float8 error into the latents) runs eagerly, uncompiled and uncaptured,
  in bf16 and then quantized, and :func:`~accel.hooks.fp8.layer_select.select_layers` keeps the
  worst layers in bf16 until the final latents are within ``fp8_budget`` (a warning where that
  leaves none in float8). The captures and compiles that follow see the weights as they will
  stay. Calls before that run in bf16 (said once).
* **Already quantized** denoisers (diffusers' ``TorchAoConfig`` / ``PipelineQuantizationConfig``
  at load, or an earlier ``quantize="fp8"``) are used as they are: not measured, not quantized
  again; the report says so.
* **One-way.** The bf16 weights of the quantized layers are let go, so :meth:`restore` takes the
  graphs and hooks out but leaves those layers in float8, with a warning; reload the model for
  bf16. Keeping them would cost more memory than not quantizing at all (counted on the released
  configs, every layer but the recipe's in float8: Qwen-Image's denoiser 38.05 GiB in bf16, 25.41
  GiB quantized, 50.72 GiB quantized with the bf16 copies kept; Z-Image's 11.46, 5.87 and 17.07).

The graphs read the float8 weights by address like any others: the weights fingerprint walks
torchao's tensors into their inner tensors (:mod:`accel.hooks.state.weights`), so a float8 model is not
"changed" on every call, while a change of its data still is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..components import module_device
from ..options import AcceleratorOptions
from .attention_layers import AttentionFloat8, FlashAttentionFloat8
from .layer_kinds import quantizer_for
from .layer_select import Selection, select_layers
from .quantizers import QuantizeError, Quantizer, quantized_when_loaded

__all__ = ["Quantization", "plan_quantization"]

logger = logging.getLogger(__name__)


def _names(names: Sequence[str], shown: int = 4) -> str:
    more = f" (+{len(names) - shown})" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _output_tensor(out: Any) -> torch.Tensor:
    """The final latents of a pipeline call made with ``output_type="latent"``."""
    value = out[0] if not isinstance(out, torch.Tensor) else out
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        value = torch.stack(list(value))
    if not isinstance(value, torch.Tensor):
        raise QuantizeError(f"quantize: the warm-up call returned {type(value).__name__}, not latents to measure")
    return value


@dataclasses.dataclass(eq=False)
class Quantization:
    """What ``quantize=`` does to one pipeline's denoisers.

    Attributes:
        value: the ``quantize=`` value (None where only quantized-when-loaded weights are reported).
        quantizer: the quantizer (None without ``value``).
        budget: ``fp8_budget``.
        roots: the denoisers it quantizes, by component name.
        loaded: the denoisers quantized before (when loaded, or by an earlier ``quantize=``),
            and how, as a phrase.
        selection: what the first warm-up selected and measured (None before).
        where: the call that was measured (size, batch, steps).
    """

    value: str | None
    quantizer: Quantizer | None
    budget: float
    roots: dict[str, torch.nn.Module]
    loaded: dict[str, str]
    selection: Selection | None = dataclasses.field(default=None, init=False)
    where: str | None = dataclasses.field(default=None, init=False)
    # Float8 attention, where the denoisers' attention has a float8 version (attention="fa3").
    attention: AttentionFloat8 = dataclasses.field(default_factory=FlashAttentionFloat8, init=False)
    _calibrating: bool = dataclasses.field(default=False, init=False, repr=False)
    _said_pending: bool = dataclasses.field(default=False, init=False, repr=False)

    @property
    def pending(self) -> bool:
        """Whether a warm-up still has layers to measure and quantize."""
        return self.quantizer is not None and self.selection is None and bool(self.roots)

    def calibrate(
        self,
        pipe: Any,
        kwargs: Mapping[str, Any],
        device: torch.device,
        keep: Mapping[str, Sequence[str]],
        where: str,
        paused: contextlib.AbstractContextManager[Any],
    ) -> Selection:
        """Select and quantize the layers on one pipeline call (``kwargs``, seeded the same every
        time, ``output_type="latent"``), with the runners ``paused`` and compiled blocks run
        eagerly; ``keep``: each denoiser's recipe patterns (see :func:`select_layers`)."""
        assert self.quantizer is not None and self.pending
        progress = dict(getattr(pipe, "_progress_bar_config", {}))
        pipe.set_progress_bar_config(disable=True)

        def run() -> torch.Tensor:
            return _output_tensor(pipe(**kwargs, generator=torch.Generator(device).manual_seed(0)))

        self._calibrating = True
        try:
            with paused, torch.compiler.set_stance("force_eager"), torch.no_grad():
                self.selection = select_layers(
                    self.roots, self.quantizer, keep, run, self.budget, attention=self.attention
                )
        finally:
            self._calibrating = False
            pipe._progress_bar_config = progress
        self.where = where
        logger.info("quantize:\n%s", "\n".join(self.describe()))
        s = self.selection
        if not s.quantized and s.kept_measured:
            # Calls then run exactly as without quantize=: said where it is seen, not only in the report.
            logger.warning(
                "quantize=%r: every Linear layer stays in bf16: the measured call (%s) was %.2f%% from bf16 with "
                "every candidate in float8 and beyond the budget (%.2f%%) with as many as the search kept in bf16; "
                "a larger fp8_budget, or a measured call like the ones made (warmup(measure_cfg=...)), keeps some",
                self.value,
                where,
                s.all_quantized_error * 100,
                s.budget * 100,
            )
        return self.selection

    def note_call(self) -> None:
        """At every pipeline call: say once that nothing is quantized before a warm-up."""
        if self.pending and not self._calibrating and not self._said_pending:
            self._said_pending = True
            logger.warning(
                "quantize=%r: nothing is quantized until warmup(...) measures the layers; this call runs in bf16",
                self.value,
            )

    def restore(self) -> None:
        """At restore: float8 attention goes back to bf16 (nothing of it was freed); say what stays
        quantized (quantize= is one-way for the Linear layers)."""
        if self.selection is not None:
            for layer in self.selection.attention_layers:
                layer.restore()
        if self.selection is not None and self.selection.quantized:
            logger.warning(
                "restore(): %d Linear layers of %s stay in float8 (quantize=%r is one-way: their bf16 weights "
                "were freed); reload the model for bf16",
                len(self.selection.quantized),
                ", ".join(self.roots),
                self.value,
            )

    def summary(self) -> str:
        """One line: what ran (for an image's metadata)."""
        s = self.selection
        if s is not None:
            kept = len(s.kept_by_recipe) + len(s.kept_measured)
            attention = (
                f", {len(s.attention)} attention layers in float8 ({len(s.attention_kept)} in bf16)"
                if s.attention_backend
                else f", attention in bf16 (the recipe's {len(s.attention_by_recipe)})"
                if s.attention_by_recipe
                else ""
            )
            return (
                f"{self.value} ({self.quantizer.name}): {len(s.quantized)} Linear layers in float8, {kept} in bf16"
                f"{attention}; final latents {s.error:.2%} from bf16 (budget {s.budget:.2%})"
            )
        loaded = "; ".join(f"{n} {how}" for n, how in self.loaded.items())
        if self.pending:
            return f"{self.value} requested, not applied yet (no warm-up): bf16" + (f"; {loaded}" if loaded else "")
        return loaded or "none"

    def describe(self) -> list[str]:
        """The report's lines."""
        lines = [f"  {n}: {how}: used as it is, not measured" for n, how in self.loaded.items()]
        if self.quantizer is None:
            return lines
        head = f"  quantize {self.value} ({self.quantizer.name}: {self.quantizer.detail})"
        s = self.selection
        if s is None:
            if self.roots:
                lines.append(
                    f"{head}: nothing quantized yet: the first warmup(...) measures the layers and quantizes "
                    f"them (budget {self.budget:.2%})"
                )
            return lines
        total = len(s.quantized) + len(s.kept_by_recipe) + len(s.kept_measured) + len(s.not_taken)
        kept = len(s.kept_by_recipe) + len(s.kept_measured)
        measured = f", {len(s.kept_measured)} measured worst ({_names(s.kept_measured)})" if s.kept_measured else ""
        lines += [
            f"{head}: {len(s.quantized)} of {total} Linear layers in float8; {kept} kept in bf16 "
            f"({len(s.kept_by_recipe)} named by the recipe{measured}); {len(s.not_taken)} it cannot take",
            f"    final latents {s.error:.2%} from bf16 (max abs {s.max_abs:.3g}; every candidate in float8: "
            f"{s.all_quantized_error:.2%}), budget {s.budget:.2%}: measured at the first warm-up call "
            f"({self.where}; {s.runs} calls)",
            f"    denoiser weights {_size(s.bytes_before)} -> {_size(s.bytes_after)}",
        ]
        if s.attention_backend is not None:
            kept_attention = (
                f"; {len(s.attention_kept)} measured worst kept in bf16 ({_names(s.attention_kept)})"
                if s.attention_kept
                else ""
            )
            lines.append(
                f"    attention: {len(s.attention)} of {len(s.attention) + len(s.attention_kept)} layers in float8 "
                f"({s.attention_backend}: float8 queries, keys and values, per-head scales, keys smoothed)"
                f"{kept_attention}: {_names(s.attention, 3)}"
            )
        elif s.attention_by_recipe:
            lines.append(f"    attention: {len(s.attention_by_recipe)} layers kept in bf16 by the recipe")
        return lines


def plan_quantization(
    pipe: Any, options: AcceleratorOptions, denoisers: Sequence[str], layers: str | None = None
) -> Quantization | None:
    """What ``options.quantize`` will do to ``pipe``'s denoisers (by component name), with float8
    layers of the kind ``layers`` names (the recipe's ``fp8_layers``; None: torchao's), refused in
    one line where it cannot (QuantizeError) before anything is installed; None where there is
    nothing to quantize or report."""
    modules = {n: m for n in denoisers if isinstance(m := getattr(pipe, n, None), torch.nn.Module)}
    quantizer = quantizer_for(options.quantize, layers) if options.quantize is not None else None
    loaded: dict[str, str] = {}
    for name, module in modules.items():
        how = quantized_when_loaded(module)
        # torchao's tensors are what quantize= makes itself; another library's weights it cannot take.
        if how is not None and "torchao" not in how and quantizer is not None:
            raise QuantizeError(
                f"{name} was {how}: quantize={options.quantize!r} needs its bf16 weights; pass quantize=None "
                "to run it as it is"
            )
        earlier = quantizer is not None and (how is None or "when loaded" not in how)
        if earlier and any(quantizer.is_quantized(m) for m in module.modules()):
            how = f"quantized by an earlier quantize={options.quantize!r} ({quantizer.name})"
        if how is not None:
            loaded[name] = how
    if quantizer is None:
        return Quantization(None, None, options.fp8_budget, {}, loaded) if loaded else None
    roots = {n: m for n, m in modules.items() if n not in loaded}
    for module in roots.values():
        quantizer.check(module, module_device(module))
    return Quantization(options.quantize, quantizer, options.fp8_budget, roots, loaded)
