"""``bcg-serve --quantize fp8`` on the CPU: the server's start (prepare, then its own warm-up of
every bucket with and without guidance) with the stand-in quantizer (tests/helpers/fake_quant.py)
and CUDA graphs emulated (tests/helpers/emulator.py).

The selection measures the call a request that names no guidance makes (Z-Image's default: none),
not the warm-up's first case (guidance on, which multiplies the float8 error into the latents:
measured there, this grid keeps 25 of 28 layers in bf16, and an H100 served Z-Image 512 with
``--quantize fp8`` exactly as fast as without, its 13 measuring calls pointing to nearly every
layer kept in bf16). After the start the denoiser's layers are the quantized ones, and a served
call replays graphs that read their quantized weights.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.hooks.fp8.quantize import Quantization
from pipelines.serve.config import parse_args
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import check, starter
from tests.helpers.fake_quant import GridLinear, use_grid
from tests.pipelines.serve.test_buckets import prompt_of_warm_length

SIZE = (32, 32)
# Coarse enough that guidance matters: measured with guidance on, this grid keeps 25 of the tiny
# Z-Image's 28 candidates in bf16; measured without, none (CPU, bf16, buckets 1 2 4).
LEVELS = 8


def start(monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[Engine, list[dict[str, Any]]]:
    """The server's start with ``--quantize fp8`` (the stand-in) and the calls it measured."""
    use_grid(monkeypatch, levels=LEVELS)
    measured: list[dict[str, Any]] = []
    calibrate = Quantization.calibrate

    def recording(self: Quantization, pipe: Any, kwargs: Any, *args: Any, **kw: Any) -> Any:
        measured.append(dict(kwargs))
        return calibrate(self, pipe, kwargs, *args, **kw)

    monkeypatch.setattr(Quantization, "calibrate", recording)
    w, h = SIZE
    config = parse_args(["--quantize", "fp8", "--device", "cpu", "--dtype", "bf16", "--resolutions", f"{w}x{h}",
                         "--batch-sizes", "1", "2", "4", *flags])  # fmt: skip
    return starter(config, *check(config))(), measured


def read_by_graphs(runner: Any) -> set[int]:
    """Addresses of every tensor the runner's captured segments read or write."""
    seen: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for entry in runner.store.entries.values():
        for chain in entry.tree.chains.values():
            for segment in chain.graph.segments:
                for _, args, kwargs, _ in segment.ops:
                    walk(args)
                    walk(kwargs)
    return seen


def check_served(engine: Engine, measured: list[dict[str, Any]]) -> None:
    pipe = engine.pipe
    # One measurement, at the largest bucket, with the default call's guidance (none).
    assert len(measured) == 1, measured
    [kwargs] = measured
    assert kwargs["guidance_scale"] == 0.0 and "negative_prompt_embeds" not in kwargs, kwargs.keys()
    assert len(kwargs["prompt_embeds"]) == 4
    quantization = pipe.accel.quantization
    assert "batch 4, guidance off, 2 steps" in quantization.where
    sel = quantization.selection
    assert sel is not None and sel.error <= sel.budget
    assert len(sel.quantized) > len(sel.kept_measured), (len(sel.quantized), sel.kept_measured)
    # The denoiser's layers are the quantized ones, and the PNG text says so.
    layers = {name: pipe.transformer.get_submodule(name) for name in sel.quantized}
    assert all(type(m) is GridLinear for m in layers.values())
    assert f"{len(sel.quantized)} Linear layers in float8" in engine.prepared.text()["quantize"]

    # A served call replays graphs (no eager denoiser call), and those graphs read the quantized weights.
    prompt = prompt_of_warm_length(pipe, pipe.accel.recipes["transformer"], random.Random(0), SIZE)
    replays, eager = engine.denoiser_counts()
    [images] = engine.make([engine.plan(ImageRequest(prompt, 3, *SIZE, seed=7, steps=2))])
    assert len(images) == 3
    after = engine.denoiser_counts()
    assert after[0] > replays and after[1] == eager, (replays, eager, after)
    read = read_by_graphs(pipe.accel.hooks["transformer"].runner)
    unread = [n for n, m in layers.items() if m.qweight.untyped_storage().data_ptr() not in read]
    assert not unread, f"the graphs read no quantized weights of {unread}"


def test_the_served_calls_run_the_layers_measured_on_the_default_call(emulated: pytest.MonkeyPatch) -> None:
    engine, measured = start(emulated)
    check_served(engine, measured)


def test_the_same_with_compiled_blocks(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--compile`` as on the GPU (dynamo, dynamic shapes; its eager backend here): the blocks
    compile after the selection, over the quantized layers."""
    import accel.hooks.compiled.compile as compile_mod

    emulated.setattr(compile_mod, "why_not_compiled", lambda module: None)
    emulated.setattr(compile_mod, "COMPILE_OPTIONS", dict(fullgraph=False, dynamic=True, backend="eager"))
    emulated.setattr(torch.cuda, "get_rng_state", lambda *a, **k: None)
    emulated.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)
    torch._dynamo.reset()
    try:
        engine, measured = start(emulated, "--compile", "--compile-cache", str(tmp_path / "kernels"))
        assert engine.pipe.accel.options.compile
        check_served(engine, measured)
    finally:
        torch._dynamo.reset()  # compiled code holds the modules it was compiled for
