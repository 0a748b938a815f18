"""The denoiser's matrix products at the model's shapes: which Linear layers a step calls, with which
(M, K, N), in float8 or bf16; their FLOPs; and each shape's rate measured alone on the device.

:func:`record_linears` runs one step with a forward pre-hook on every ``nn.Linear`` of the model
(before anything is compiled or quantized: names stay, and a hook on a compiled block would make it
compile again) and keeps each call's (M, K, N): M the rows of its input (tokens times batch), K
its input features, N its output features. :func:`gemm_rows` groups them by shape and by whether
the layer runs in float8 (the names a quantization selected). :func:`measure_rates` times each
shape alone, as the step runs it: bf16 as ``F.linear``; float8 as ``torch._scaled_mm`` on e4m3
operands with per-row scales and fast accumulation (what torchao's per-row float8 and the
library's scaled_mm quantizer call), the activation's quantization left out (the profile shows it
as its own kernels).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["GemmRow", "gemm_rows", "measure_bandwidth", "measure_rates", "median_seconds", "record_linears"]

Shape = tuple[int, int, int]  # (M, K, N)


@dataclasses.dataclass
class GemmRow:
    """One shape of product in a step: ``calls`` per step, by ``layers`` (qualified names)."""

    m: int
    k: int
    n: int
    fp8: bool
    calls: int
    layers: list[str]
    tflops: float | None = None  # measured alone on the device (None: not measured)

    @property
    def flops(self) -> int:
        """FLOPs of one call (a multiply and an add per term)."""
        return 2 * self.m * self.k * self.n

    @property
    def bytes(self) -> int:
        """Bytes one call moves at least: its weight and input read once (float8: a byte an element,
        bf16: two) and its bf16 output written once. What bounds the small-M products (a
        modulation's one row, a short text): they read a whole weight for a few rows."""
        size = 1 if self.fp8 else 2
        return (self.k * self.n + self.m * self.k) * size + self.m * self.n * 2

    @property
    def gflop_per_step(self) -> float:
        return self.flops * self.calls / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {
            "m": self.m,
            "k": self.k,
            "n": self.n,
            "dtype": "fp8" if self.fp8 else "bf16",
            "calls_per_step": self.calls,
            "flop_per_step": self.flops * self.calls,
            "gflop_per_step": round(self.gflop_per_step, 3),
            "tflops_alone": None if self.tflops is None else round(self.tflops, 1),
            "ms_per_step_alone": None if not self.tflops else round(self.gflop_per_step / self.tflops, 4),
            "layers": len(self.layers),
            "example": self.layers[0] if self.layers else "",
        }


def record_linears(model: torch.nn.Module, step: Callable[[], Any]) -> dict[str, list[Shape]]:
    """Every ``nn.Linear`` call of one ``step()`` by qualified name: its (M, K, N), in call order."""
    calls: dict[str, list[Shape]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(mod: torch.nn.Module, args: tuple, name: str = name) -> None:
                x = args[0]
                k = int(x.shape[-1])
                calls.setdefault(name, []).append((x.numel() // k if k else 0, k, int(mod.out_features)))

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            step()
    finally:
        for h in handles:
            h.remove()
    return calls


def gemm_rows(calls: dict[str, list[Shape]], fp8_layers: Iterable[str]) -> list[GemmRow]:
    """The calls grouped by (M, K, N, float8), most FLOPs per step first."""
    fp8 = set(fp8_layers)
    rows: dict[tuple[int, int, int, bool], GemmRow] = {}
    for name, shapes in calls.items():
        for m, k, n in shapes:
            key = (m, k, n, name in fp8)
            row = rows.setdefault(key, GemmRow(m, k, n, name in fp8, 0, []))
            row.calls += 1
            if name not in row.layers:
                row.layers.append(name)
    return sorted(rows.values(), key=lambda r: -r.gflop_per_step)


def _operands(row: GemmRow, device: torch.device) -> Callable[[], Any]:
    """A callable that runs ``row``'s product once, as the step runs it."""
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(row.m, row.k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(row.n, row.k, device=device, dtype=torch.bfloat16, generator=g)
    if not row.fp8:
        return lambda: torch.nn.functional.linear(x, w)
    from accel.hooks.fp8 import quantize_rows

    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    ws = ws.reshape(1, -1)
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=True)


def measure_rates(rows: list[GemmRow], device: torch.device, repeats: int = 20, blocks: int = 3) -> None:
    """Time each row's product alone (CUDA events, ``repeats`` back to back, the median of
    ``blocks``); fills ``row.tflops``. Nothing on a CPU."""
    if device.type != "cuda":
        return
    for row in rows:
        run = _operands(row, device)
        row.tflops = row.flops / median_seconds(run, repeats, blocks, warm=3) / 1e12
        del run
    torch.cuda.empty_cache()


def median_seconds(run: Callable[[], Any], repeats: int, blocks: int, warm: int = 2) -> float:
    """Seconds one ``run()`` takes on the current CUDA stream: ``warm`` untimed calls, then
    ``blocks`` blocks of ``repeats`` calls back to back, each timed with CUDA events; the median block's per call."""
    for _ in range(warm):
        run()
    per_call = []
    for _ in range(blocks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(per_call)


def measure_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 10) -> float | None:
    """The device memory's rate in TB/s, bytes read plus written by a ``mib`` MiB copy (the median
    of ``repeats``): the rate a product that streams its weight can reach. None on a CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    took = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        took.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * mib * 2**20 / statistics.median(took) / 1e12
