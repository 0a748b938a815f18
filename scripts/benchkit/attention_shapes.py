"""The denoiser's attention at the model's shapes: which attention modules a step calls, with which
(batch, query tokens, key tokens, heads, head dim); their FLOPs; each shape's rate measured alone.

:func:`record_attention` runs one step with a forward pre-hook on every attention module (naming
the module that runs) and the active backend of diffusers' attention dispatch wrapped for the
step (reading the queries' and keys' shapes): the stock model, before anything is compiled.
:func:`measure_attention_rates` times each shape alone on the device: torch's SDPA (cuDNN's
kernel, as the stock models run it), FlashAttention-3 in bf16 and FlashAttention-3 on float8
operands with per-head descales (the quantization left out, as the profile shows it apart); the
wheel missing, its rates stay None and the floor says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .gemm_shapes import median_seconds

__all__ = ["AttentionRow", "attention_rows", "measure_attention_rates", "record_attention"]

Shape = tuple[int, int, int, int, int]  # (batch, query tokens, key tokens, heads, head dim)
RATES = ("sdpa", "fa3", "fa3_fp8")


@dataclasses.dataclass
class AttentionRow:
    """One attention shape of a step: ``calls`` per step, by ``layers`` (module paths)."""

    batch: int
    sq: int
    sk: int
    heads: int
    dim: int
    fp8: bool
    calls: int
    layers: list[str]
    tflops: dict[str, float | None] = dataclasses.field(default_factory=lambda: dict.fromkeys(RATES))

    @property
    def flops(self) -> int:
        """FLOPs of one call: two products (scores, then the weighted sum of values), a multiply
        and an add per term."""
        return 4 * self.batch * self.heads * self.sq * self.sk * self.dim

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "query_tokens": self.sq,
            "key_tokens": self.sk,
            "heads": self.heads,
            "head_dim": self.dim,
            "dtype": "fp8" if self.fp8 else "bf16",
            "calls_per_step": self.calls,
            "flop_per_step": self.flops * self.calls,
            "tflops_alone": {k: None if v is None else round(v, 1) for k, v in self.tflops.items()},
            "layers": len(self.layers),
            "example": self.layers[0] if self.layers else "",
        }


def record_attention(model: torch.nn.Module, step: Callable[[], Any]) -> dict[str, list[Shape]]:
    """Every attention call of one ``step()`` through diffusers' dispatch, by the path of the
    attention module that made it: its (batch, query tokens, key tokens, heads, head dim)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    from diffusers.models.attention_processor import Attention

    calls: dict[str, list[Shape]] = {}
    running: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, (Attention, AttentionModuleMixin)):
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: running.append(name)))
            handles.append(module.register_forward_hook(lambda m, a, o: running.pop() and None))
    backends = _AttentionBackendRegistry._backends
    used = {getattr(p, "_attention_backend", None) for p in _processors(model)} - {None}
    used.add(_AttentionBackendRegistry._active_backend)
    originals = {b: backends[b] for b in used if b in backends}

    def recording(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def record(**kwargs: Any) -> torch.Tensor:
            q, k = kwargs["query"], kwargs["key"]
            if running and q.dim() == 4:
                shape = (int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), int(q.shape[3]))
                calls.setdefault(running[-1], []).append(shape)
            return fn(**kwargs)

        return record

    try:
        for b, fn in originals.items():
            backends[b] = recording(fn)
        with torch.no_grad():
            step()
    finally:
        backends.update(originals)
        for h in handles:
            h.remove()
    return calls


def _processors(model: torch.nn.Module) -> Iterable[Any]:
    for m in model.modules():
        p = getattr(m, "processor", None)
        if p is not None:
            yield p


def attention_rows(calls: dict[str, list[Shape]], fp8_layers: Iterable[str]) -> list[AttentionRow]:
    """The calls grouped by shape and float8, most FLOPs per step first."""
    fp8 = set(fp8_layers)
    rows: dict[tuple[Any, ...], AttentionRow] = {}
    for name, shapes in calls.items():
        for shape in shapes:
            key = (*shape, name in fp8)
            row = rows.setdefault(key, AttentionRow(*shape, fp8=name in fp8, calls=0, layers=[]))
            row.calls += 1
            if name not in row.layers:
                row.layers.append(name)
    return sorted(rows.values(), key=lambda r: -r.flops * r.calls)


def _runs(row: AttentionRow, device: torch.device) -> dict[str, Callable[[], Any] | None]:
    """A callable per rate that runs ``row``'s attention once, as the step would."""
    from accel.hooks.attention import fa3

    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(row.batch, row.sq, row.heads, row.dim, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(row.batch, row.sk, row.heads, row.dim, device=device, dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    t = [x.transpose(1, 2) for x in (q, k, v)]
    runs: dict[str, Callable[[], Any] | None] = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(*t),
        "fa3": None,
        "fa3_fp8": None,
    }
    if fa3.why_not_fa3(device) is None:
        q8, qs = fa3.quantize_heads(q)
        k8, ks = fa3.quantize_heads(k, smooth=True)
        v8, vs = fa3.quantize_heads(v)
        runs["fa3"] = lambda: fa3._call(q, k, v, None, None, False)
        runs["fa3_fp8"] = lambda: fa3._call(q8, k8, v8, None, None, False, (qs, ks, vs))
    return runs


def measure_attention_rates(rows: list[AttentionRow], device: torch.device, repeats: int = 10, blocks: int = 3) -> None:
    """Time each row's attention alone per kernel (CUDA events, ``repeats`` back to back, the
    median of ``blocks``); fills ``row.tflops``. Nothing on a CPU."""
    if device.type != "cuda":
        return
    for row in rows:
        for rate, run in _runs(row, device).items():
            if run is not None:
                row.tflops[rate] = row.flops / median_seconds(run, repeats, blocks) / 1e12
    torch.cuda.empty_cache()
