"""A bcg-serve --ray replica's adapter slots on a GPU (bf16, CUDA graphs; the tiny Z-Image-style
model, three random LoRAs at scales 1, 0.7 and 1.3, two slots): after the warm-up, loading an
adapter is a hot-swap that captures nothing and, with ``--compile``, compiles nothing; every call
replays the slot's graphs; and each image equals the same request to bcg-serve's own engine with
the adapters loaded the ordinary way, bit for bit without compile (compiled: within 2 levels, the
gap printed). A scale that bfloat16 rounds (0.7 and 1.3) is within 16 levels without compile
(docs/serving-ray.md says why).

The replica is pipelines/serve/ray/replica.py's ``Replica`` (Ray-free: no Ray needed here).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipelines.serve.config import parse_args
from pipelines.serve.ray.replica import Replica
from pipelines.serve.schema import ImageRequest
from pipelines.serve.startup import check, starter
from pipelines.serve.warmup import compiled_graphs
from tests.helpers.lora_files import make_lora_file
from tests.pipelines.serve.server import decode

pytestmark = pytest.mark.cuda

SIZE = (64, 64)
TINY = ["--model", "z-image", "--resolutions", "64x64", "--batch-sizes", "1", "2", "--device", "cuda"]


def image(engine: Any, request: ImageRequest) -> np.ndarray:
    (made,) = engine.run([engine.plan(request)])
    return np.asarray(decode(made[0].b64_json)).astype(int)


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled-graphs"])
def test_a_hot_swap_replays_the_slot_graphs_and_equals_the_plain_load(tmp_path: Path, compiled: bool) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    files = {name: make_lora_file("z-image", tmp_path / f"{name}.safetensors", seed=seed, alpha=alpha)
             for name, seed, alpha in (("ink", 2, 8), ("oil", 3, 4), ("gum", 4, 8))}  # fmt: skip
    loras = ["--lora", f"ink={files['ink']}", "--lora", f"oil={files['oil']}:0.7", "--lora", f"gum={files['gum']}:1.3"]
    flags = [*TINY, *(["--compile", "--compile-cache", str(tmp_path / "cache")] if compiled else []), *loras]
    replica = Replica(flags, max_models=2)
    replica.wait_ready()
    engine, slots = replica.service.engine, replica.slots
    config = parse_args(flags)
    reference = starter(config, *check(config))()
    stats = engine.pipe.accel.stats()["transformer"]
    captures = stats.captures
    order = [("ink", True), ("oil", True), ("ink", False), ("gum", True), ("oil", False), ("gum", False)]
    for i, (name, swapped) in enumerate(order):
        if name == "gum":
            slots.release("ink")
        _, did = slots.load(name, timeout=60)
        assert did == swapped, name
        request = ImageRequest("a red fox in the snow", 1, *SIZE, seed=10 + i, steps=4, lora=name)
        replays, eager = engine.denoiser_counts()
        got = image(engine, request)
        after = engine.denoiser_counts()
        assert after[1] == eager and after[0] > replays, f"{name}: a call ran its denoiser eagerly"
        want = image(reference, request)
        d = np.abs(got - want)
        sys.stderr.write(f"{'compiled ' if compiled else ''}{name} hot-swapped: "
                         f"{'bit for bit' if not d.any() else f'max {d.max()} levels'} against the plain load\n")  # fmt: skip
        # Without compile the kernels are the same, but the slot multiplies by its scale tensor
        # rounded to bfloat16 where the plain load multiplies by the float32 number: bit for bit
        # where that rounding is exact. Compiled, inductor reads the slot's scale from memory where it
        # folds the plain load's constant into its kernel: promised only within rounding.
        scale = slots.specs(name)[0].scale
        exact = float(torch.tensor(scale, dtype=torch.bfloat16)) == scale
        bound = 2 if compiled else 0 if exact else 16
        assert d.max() <= bound, f"{name}: max {d.max()} levels from bcg-serve's plain load (bound {bound})"
    assert engine.pipe.accel.stats()["transformer"].captures == captures, "a hot-swap was captured again"
    if compiled:
        # The reference compiled its own graphs after the replica's warm-up; count the replica's calls alone.
        before = compiled_graphs()
        slots.release("oil")
        slots.load("ink", timeout=60)
        image(engine, ImageRequest("a red fox in the snow", 1, *SIZE, seed=3, steps=4, lora="ink"))
        assert compiled_graphs() == before, "a hot-swap made dynamo compile again"
    sys.stderr.write(f"swaps: {[round(s, 4) for s in slots.swap_seconds]} s\n")
    replica.stop()
