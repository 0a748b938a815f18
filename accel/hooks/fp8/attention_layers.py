"""Float8 attention as layers of ``quantize="fp8"``'s selection, measured like the Linear ones.

Where the denoisers' attention runs on FlashAttention-3 (``attention="fa3"``, or diffusers'
``set_attention_backend("bcg_fa3")``), each attention module is a candidate: in float8 its
processor dispatches to :data:`~accel.hooks.attention.backends.FA3_FP8` (float8 queries, keys and
values, per-head scales, keys smoothed), in bf16 to :data:`~accel.hooks.attention.backends.FA3`.
:func:`~accel.hooks.fp8.layer_select.select_layers` measures each one's output against bf16 on
the same call as the Linear layers (:func:`measuring`) and keeps the worst of all of them in
bf16, as few as ``fp8_budget`` allows. A processor that several modules share is not a candidate
(it cannot be set per layer).

:class:`AttentionFloat8` is the interface the selection is written against (which backends are
bf16 and float8 for a processor); :class:`FlashAttentionFloat8` is the library's. The switch is a
patch of the processor's ``_attention_backend`` (the guard watches it), undone by :meth:`AttentionLayer.restore`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ...graphs.patches import Patch, patch
from ..attention.backends import FA3, FA3_FP8, dispatching_processors, member

__all__ = ["AttentionFloat8", "AttentionLayer", "FlashAttentionFloat8", "attention_layers", "measuring"]

logger = logging.getLogger(__name__)

# The attention module running now, by its layer name (set around each candidate's forward while
# the selection measures; read by the measuring backend).
_current: list[str] = []


class AttentionFloat8(abc.ABC):
    """Which attention backends are a processor's bf16 and float8 versions.

    Attributes:
        name: what the report calls it.
        bf16, fp8: the backend names (registered in diffusers' dispatch).
    """

    name: str = "float8 attention"
    bf16: str
    fp8: str

    def takes(self, processor: Any) -> bool:
        """Whether ``processor`` runs the bf16 backend now (so it has a float8 version)."""
        backend = getattr(processor, "_attention_backend", None)
        return backend is not None and str(getattr(backend, "value", backend)) == self.bf16

    @abc.abstractmethod
    def functions(self) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
        """The (bf16, float8) backend functions, for measuring one against the other."""


class FlashAttentionFloat8(AttentionFloat8):
    """FlashAttention-3 in bf16 and in float8 (:mod:`accel.hooks.attention.fa3`)."""

    name = "FlashAttention-3 float8"
    bf16, fp8 = FA3, FA3_FP8

    def functions(self) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
        from ..attention.fa3 import fa3_attention, fa3_fp8_attention

        return fa3_attention, fa3_fp8_attention


@dataclasses.dataclass
class AttentionLayer:
    """One attention module in the selection: its processor switched between the two backends.

    Shares :class:`~accel.hooks.fp8.layer_select.Layer`'s interface (``name``, ``error``,
    ``use``; ``bf16`` and ``quantized`` say which versions may still be used)."""

    name: str
    module: torch.nn.Module
    processor: Any
    backends: AttentionFloat8
    error: float = 0.0
    bf16: bool | None = True
    quantized: bool | None = True
    _patch: Patch | None = None

    def use(self, quantized: bool) -> None:
        if quantized and self._patch is None:
            why = f"quantize: float8 attention ({self.backends.name})"
            self._patch = patch(self.processor, "_attention_backend", member(self.backends.fp8), why=why, where="dict")
        elif not quantized and self._patch is not None:
            self._patch.undo()
            self._patch = None

    def restore(self) -> None:
        """Back to bf16 attention (at restore: nothing of it was freed)."""
        self.use(quantized=False)


def attention_layers(
    roots: Mapping[str, torch.nn.Module],
    backends: AttentionFloat8,
    keep: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[AttentionLayer], list[str]]:
    """The candidates: every attention module of ``roots`` whose processor is its own and runs
    ``backends.bf16`` now; and the names of those that ``keep`` (fnmatch patterns of module
    paths, by component, as for the Linear layers) keeps in bf16."""
    several = len(roots) > 1
    layers, kept = [], []
    for component, root in roots.items():
        patterns = (keep or {}).get(component, ())
        through, _ = dispatching_processors(root)
        owners: dict[int, int] = {}
        for _, processor in through:
            owners[id(processor)] = owners.get(id(processor), 0) + 1
        for path, processor in through:
            if owners[id(processor)] == 1 and backends.takes(processor):
                name = f"{component}.{path}" if several else path
                if any(fnmatch.fnmatchcase(path, p) for p in patterns):
                    kept.append(name)
                    continue
                layers.append(AttentionLayer(name, root.get_submodule(path), processor, backends))
    return layers, kept


@contextlib.contextmanager
def measuring(
    layers: Sequence[AttentionLayer], backends: AttentionFloat8 | None
) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """While in it, each float8 attention call also computes its bf16 output from the same
    queries, keys and values, and adds up (squared difference, squared bf16 output) per layer on
    the device, as the Linear layers' measurement does."""
    sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if not layers or backends is None:
        yield sums
        return
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    reference, quantized = backends.functions()
    held = []
    for layer in layers:
        device = next((p.device for p in layer.module.parameters()), torch.device("cpu"))
        sums[layer.name] = tuple(torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
        stock = layer.module.forward

        def forward(*args: Any, _stock=stock, _name=layer.name, **kwargs: Any) -> Any:
            _current.append(_name)
            try:
                return _stock(*args, **kwargs)
            finally:
                _current.pop()

        held.append(patch(layer.module, "forward", forward, why="quantize: attention measured", where="dict"))

    def measured(**kwargs: Any) -> torch.Tensor:
        out = quantized(**kwargs)
        acc = sums.get(_current[-1]) if _current else None
        if acc is not None:
            ref = reference(**kwargs)
            acc[0].add_((out.float() - ref.float()).square().sum())
            acc[1].add_(ref.float().square().sum())
        return out

    held.append(
        patch(
            _AttentionBackendRegistry._backends,
            member(backends.fp8),
            measured,
            why="quantize: attention measured",
            where="item",
        )
    )
    try:
        yield sums
    finally:
        for p in reversed(held):
            p.undo()
