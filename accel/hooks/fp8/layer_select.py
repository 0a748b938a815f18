"""Which Linear layers ``quantize=`` puts in float8: measured on one call, kept within a budget.

:func:`select_layers`, against any :class:`~accel.hooks.fp8.quantizers.Quantizer`:

1. Candidates: every ``nn.Linear`` of the denoisers that the quantizer takes, except those the
   recipe keeps in bf16 (its ``fp8_keep`` patterns: embedders, modulation, the final projection)
   and PEFT's own layers (a LoRA's ``lora_A`` / ``lora_B`` and the layer they wrap).
2. Every candidate is quantized; both versions of each layer are kept (:class:`Layer`) while the
   selection runs, so the weights take about 1.5 times their bf16 bytes until it ends.
3. The call runs with every layer in bf16 (the reference), then quantized with each layer also
   computing its bf16 output from the same input: a layer's error is the L2 norm of its output's
   difference over the norm of its bf16 output, over every call of it.
4. Within ``budget`` (the relative L2 distance of the call's final latents to the reference):
   done. Otherwise the worst layers go back to bf16, as few as the budget allows: 1, 2, 4, ...
   until a count is within it, then halving the interval until it is known to an eighth.
5. What is not used is let go: the bf16 weights of the quantized layers, the quantized versions
   of the kept ones. A failure anywhere puts every layer back in bf16.

Where the denoisers' attention runs a backend with a float8 version (``attention``:
:mod:`accel.hooks.fp8.attention_layers`), each attention module is a candidate too, measured on
the same calls and ranked with the Linear layers by its own output's error, unless the recipe's
``fp8_keep`` names it.

The calls are the caller's (``run``): one pipeline call, the same every time, returning its final
latents. Counts and errors are the same on every run of the same call on the same device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ...graphs.patches import patch
from .attention_layers import AttentionFloat8, AttentionLayer, attention_layers, measuring
from .quantizers import Quantizer, module_bytes

__all__ = ["Layer", "Selection", "candidates", "distance", "select_layers"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _State:
    """One version of a layer: the module in its parent's slot and that module's attributes
    (its parameter and buffer tables copied), exactly as they were."""

    module: torch.nn.Module
    attrs: dict[str, Any]

    @classmethod
    def of(cls, module: torch.nn.Module) -> _State:
        attrs = dict(vars(module))
        attrs["_parameters"] = dict(module._parameters)
        attrs["_buffers"] = dict(module._buffers)
        return cls(module, attrs)

    def put(self, parent: torch.nn.Module, attr: str) -> None:
        current = vars(self.module)
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        current.update(self.attrs)
        current["_parameters"] = dict(self.attrs["_parameters"])
        current["_buffers"] = dict(self.attrs["_buffers"])
        parent._modules[attr] = self.module


@dataclasses.dataclass
class Layer:
    """A Linear layer being selected: its bf16 version, its quantized one, its measured error."""

    name: str
    parent: torch.nn.Module
    attr: str
    bf16: _State | None
    quantized: _State | None = None
    error: float = 0.0

    def use(self, quantized: bool) -> None:
        state = self.quantized if quantized else self.bf16
        assert state is not None, f"{self.name}: that version was let go"
        state.put(self.parent, self.attr)


@dataclasses.dataclass(frozen=True)
class Selection:
    """What :func:`select_layers` decided and measured.

    Attributes:
        quantized: the layers in float8.
        kept_by_recipe: those the recipe keeps in bf16.
        kept_measured: those measured worst and kept in bf16, worst first.
        not_taken: Linear layers the quantizer cannot take (their shape or dtype), PEFT's, and those
            whose float8 product the device refused at the measured call.
        errors: every quantized candidate's relative output error, measured with all of them in float8.
        error: the final latents' relative L2 distance to bf16 with this selection.
        max_abs: their largest absolute difference.
        all_quantized_error: the same with every candidate in float8.
        budget: the budget it was selected for.
        runs: the calls it made (the reference included).
        bytes_before, bytes_after: the denoisers' parameter and buffer bytes before and after.
        attention: the attention modules whose attention runs in float8.
        attention_kept: those measured worst and kept in bf16, worst first.
        attention_backend: what runs the float8 attention (None: no attention was a candidate).
        attention_by_recipe: the attention modules the recipe keeps in bf16 (never candidates).
    """

    quantized: tuple[str, ...]
    kept_by_recipe: tuple[str, ...]
    kept_measured: tuple[str, ...]
    not_taken: tuple[str, ...]
    errors: Mapping[str, float]
    error: float
    max_abs: float
    all_quantized_error: float
    budget: float
    runs: int
    bytes_before: int
    bytes_after: int
    attention: tuple[str, ...] = ()
    attention_kept: tuple[str, ...] = ()
    attention_backend: str | None = None
    attention_by_recipe: tuple[str, ...] = ()
    attention_layers: tuple[AttentionLayer, ...] = dataclasses.field(default=(), repr=False, compare=False)


def distance(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 distance, largest absolute difference) of ``out`` from ``ref``; inf where
    ``out`` is not finite."""
    d = out.detach().double() - ref.detach().double()
    rel = (d.norm() / ref.detach().double().norm().clamp_min(1e-30)).item()
    biggest = d.abs().max().item() if d.numel() else 0.0
    if not (math.isfinite(rel) and math.isfinite(biggest)):
        return math.inf, math.inf
    return rel, biggest


def _owned_by_peft(name: str, modules: Mapping[str, torch.nn.Module]) -> bool:
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return True
    parent = modules.get(".".join(parts[:-1]))
    return parts[-1] == "base_layer" and parent is not None and hasattr(parent, "lora_A")


def candidates(
    root: torch.nn.Module, quantizer: Quantizer, keep: Sequence[str]
) -> tuple[list[str], list[str], list[str]]:
    """Names of ``root``'s Linear layers: (to quantize, kept by the ``keep`` patterns, not taken)."""
    modules = dict(root.named_modules())
    chosen, kept, not_taken = [], [], []
    for name, m in modules.items():
        if not isinstance(m, torch.nn.Linear):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in keep):
            kept.append(name)
        elif _owned_by_peft(name, modules) or not quantizer.takes(m):
            not_taken.append(name)
        else:
            chosen.append(name)
    return chosen, kept, not_taken


@contextlib.contextmanager
def _measuring(
    layers: Sequence[Layer], refused: dict[str, str]
) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Each quantized layer's forward also computes its bf16 output from the same input and adds
    up (squared difference, squared bf16 output), on the device: read once, at the end.

    A layer whose float8 product the device refuses (cuBLASLt's per-row float8 product rejects
    some shapes on Hopper, a large input width over a few rows) answers with its bf16 output and
    is named in ``refused`` with the reason: it stays in bf16."""
    sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    held = []
    for layer in layers:
        assert layer.bf16 is not None and layer.quantized is not None
        module = layer.quantized.module
        weight, bias = layer.bf16.attrs["_parameters"]["weight"], layer.bf16.attrs["_parameters"].get("bias")
        acc = tuple(torch.zeros((), dtype=torch.float64, device=weight.device) for _ in range(2))
        sums[layer.name] = acc
        stock = module.forward

        def forward(
            x: torch.Tensor, *args: Any, _stock=stock, _w=weight, _b=bias, _acc=acc, _name=layer.name, **kwargs: Any
        ) -> Any:
            ref = F.linear(x, _w, _b)
            if _name in refused:
                return ref
            try:
                out = _stock(x, *args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # raised by the library's shape checks, before any kernel runs
                refused[_name] = str(e).splitlines()[0][:200]
                return ref
            _acc[0].add_((out.float() - ref.float()).square().sum())
            _acc[1].add_(ref.float().square().sum())
            return out

        held.append(patch(module, "forward", forward, why="quantize: each layer measured against bf16", where="dict"))
    try:
        yield sums
    finally:
        for p in reversed(held):
            p.undo()


def _relative(num: torch.Tensor, den: torch.Tensor) -> float:
    n, d = num.item(), den.item()
    if not math.isfinite(n) or not math.isfinite(d):
        return math.inf
    return math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf)


def _layers(roots: Mapping[str, torch.nn.Module], names: Mapping[str, Sequence[str]]) -> list[Layer]:
    out = []
    several = len(roots) > 1
    for component, root in roots.items():
        for name in names[component]:
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name)
            shown = f"{component}.{name}" if several else name
            out.append(Layer(shown, parent, attr, _State.of(parent._modules[attr])))
    return out


def _search(n: int, budget: float, error_keeping: Callable[[int], float], first: float) -> tuple[int, dict[int, float]]:
    """The smallest count of worst layers kept in bf16 (to an eighth) whose error is within
    ``budget``: doubling, then halving the interval; and every count's error measured."""
    measured = {0: first}
    if first <= budget:
        return 0, measured
    lo, hi, k = 0, n, 1
    while k < n:
        measured[k] = error_keeping(k)
        if measured[k] <= budget:
            hi = k
            break
        lo, k = k, k * 2
    if hi == n:
        measured[n] = error_keeping(n)  # every layer in bf16: the reference itself, or its noise
    while hi - lo > max(1, hi // 8):
        mid = (lo + hi) // 2
        measured[mid] = error_keeping(mid)
        if measured[mid] <= budget:
            hi = mid
        else:
            lo = mid
    return hi, measured


def select_layers(
    roots: Mapping[str, torch.nn.Module],
    quantizer: Quantizer,
    keep: Mapping[str, Sequence[str]],
    run: Callable[[], torch.Tensor],
    budget: float,
    attention: AttentionFloat8 | None = None,
) -> Selection:
    """Quantize ``roots``' Linear layers (by component name) with ``quantizer``, and their
    attention with ``attention`` where it takes it, keeping in bf16 what the recipe names
    (``keep``, fnmatch patterns by component) and the worst measured ones until ``run()``'s
    output is within ``budget`` of bf16 (see the module docstring)."""
    bytes_before = sum(module_bytes(r) for r in roots.values())
    chosen: dict[str, list[str]] = {}
    kept_by_recipe: list[str] = []
    not_taken: list[str] = []
    several = len(roots) > 1
    for component, root in roots.items():
        names, kept, skipped = candidates(root, quantizer, keep.get(component, ()))
        chosen[component] = names
        kept_by_recipe += [f"{component}.{n}" if several else n for n in kept]
        not_taken += [f"{component}.{n}" if several else n for n in skipped]
    layers = _layers(roots, chosen)
    attentions, kept_attention = attention_layers(roots, attention, keep) if attention is not None else ([], [])
    runs = 0

    def call() -> torch.Tensor:
        nonlocal runs
        runs += 1
        return run()

    try:
        ref = call()
        quantized: set[str] = set()
        for component, root in roots.items():
            done = quantizer.quantize(root, chosen[component])
            quantized |= {f"{component}.{n}" if several else n for n in done}
        not_taken += [layer.name for layer in layers if layer.name not in quantized]
        layers = [layer for layer in layers if layer.name in quantized]
        for layer in layers:
            layer.quantized = _State.of(layer.parent._modules[layer.attr])
        for a in attentions:
            a.use(quantized=True)
        refused: dict[str, str] = {}
        with _measuring(layers, refused) as sums, measuring(attentions, attention) as attention_sums:
            first, first_max = distance(call(), ref)
        if refused:
            logger.warning(
                "quantize: the device refused the float8 product of %d layers (%s: %s); they stay in bf16",
                len(refused),
                next(iter(refused)),
                next(iter(refused.values())),
            )
            for layer in layers:
                if layer.name in refused:
                    layer.use(quantized=False)
                    layer.quantized = None
            not_taken += list(refused)
            layers = [layer for layer in layers if layer.name not in refused]
        for layer in layers:
            layer.error = _relative(*sums[layer.name])
        for a in attentions:
            a.error = _relative(*attention_sums[a.name])
        logger.info("quantize: every candidate in float8: final latents %.4g from bf16 (budget %g)", first, budget)
        # Worst first; equal errors in model order, so the choice is the same on every run.
        ranked: list[Layer | AttentionLayer] = [*layers, *attentions]
        order = sorted(range(len(ranked)), key=lambda i: (-ranked[i].error, i))
        worst = [ranked[i] for i in order]
        maxima = {0: first_max}

        def error_keeping(k: int) -> float:
            for i, layer in enumerate(worst):
                layer.use(quantized=i >= k)
            rel, biggest = distance(call(), ref)
            maxima[k] = biggest
            logger.info("quantize: %d worst layers in bf16: final latents %.4g from bf16", k, rel)
            return rel

        k, measured = _search(len(worst), budget, error_keeping, first)
    except BaseException:
        for layer in layers:
            if layer.bf16 is not None:
                layer.use(quantized=False)
        for a in attentions:
            a.use(quantized=False)
        raise
    for i, layer in enumerate(worst):
        layer.use(quantized=i >= k)
        if i >= k:
            layer.bf16 = None  # the bf16 weights go: quantize= is one-way
        else:
            layer.quantized = None
    back = {w.name for w in worst[:k]}
    return Selection(
        quantized=tuple(layer.name for layer in layers if layer.name not in back),
        kept_by_recipe=tuple(kept_by_recipe),
        kept_measured=tuple(w.name for w in worst[:k] if isinstance(w, Layer)),
        not_taken=tuple(not_taken),
        errors={layer.name: layer.error for layer in ranked},
        error=measured[k],
        max_abs=maxima[k],
        all_quantized_error=first,
        budget=budget,
        runs=runs,
        bytes_before=bytes_before,
        bytes_after=sum(module_bytes(r) for r in roots.values()),
        attention=tuple(a.name for a in attentions if a.name not in back),
        attention_kept=tuple(w.name for w in worst[:k] if isinstance(w, AttentionLayer)),
        attention_backend=attention.name if attentions and attention is not None else None,
        attention_by_recipe=tuple(kept_attention),
        attention_layers=tuple(a for a in attentions if a.name not in back),
    )
