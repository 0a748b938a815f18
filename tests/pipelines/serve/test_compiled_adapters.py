"""``--compile`` with adapters, on the CPU (emulated graphs; dynamo through
tests/helpers/cpu_compile.py, which compiles what it would on a GPU for the same shapes): the
warm-up compiles a version of each block per variant of its calls and per adapter state it warms
(no adapter, each ``--lora``; for a Ray replica, each adapter slot), more than dynamo's default
limit of 8 for tiny Z-Image with one adapter, where ``fullgraph`` made the ninth a failed start
(seen on an H100 in a Ray replica's start); and it captures more graphs than the library keeps by
default. Checked: the warm-up passes, and afterwards every adapter state (none after each other one), and every
hot-swap replays without compiling or capturing anything.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipelines.generation import ModelSettings, Workload, prepare_pipeline, resolve_device_and_dtype
from pipelines.lora import LoraSpec
from pipelines.serve.config import graphs_kept
from pipelines.serve.engine import Engine
from pipelines.serve.ray.slots import AdapterSlots, largest_rank, slot_specs
from pipelines.serve.schema import ImageRequest
from pipelines.serve.warmup import warm_up
from tests.helpers.cpu_compile import compile_on_cpu
from tests.helpers.lora_files import make_lora_file
from tests.pipelines.serve.server import decode
from tests.pipelines.serve.test_buckets import prompt_of_warm_length

SIZE = (32, 32)
BUCKETS = (1, 2)


@pytest.fixture
def counter(emulated: pytest.MonkeyPatch) -> Iterator[Any]:
    yield compile_on_cpu(emulated)
    torch._dynamo.reset()  # compiled code holds the modules it was compiled for


@pytest.fixture
def catalog(tmp_path: Path) -> tuple[LoraSpec, ...]:
    return (
        LoraSpec(make_lora_file("z-image", tmp_path / "ink.safetensors", seed=2), 1.0, "ink"),
        LoraSpec(make_lora_file("z-image", tmp_path / "oil.safetensors", seed=3, alpha=4), 0.7, "oil"),
    )


def _engine(loras: tuple[LoraSpec, ...], cache: Path) -> tuple[Engine, Any]:
    s = ModelSettings(
        model="z-image",
        device="cpu",
        warmup=(),
        loras=loras,
        compile=True,
        compile_cache=cache,
        max_entries=graphs_kept(1, len(BUCKETS), len(loras)),
    )  # as bcg-serve's flags set it
    device, dtype = resolve_device_and_dtype(s)
    prepared = prepare_pipeline(s, Workload(resolutions=[SIZE], prompts=("x",)), device, dtype, progress=False)
    return Engine(prepared, BUCKETS), prepared


def _image(engine: Engine, request: ImageRequest) -> np.ndarray:
    (made,) = engine.run([engine.plan(request)])
    return np.asarray(decode(made[0].b64_json))


def _request(engine: Engine, rng: random.Random, lora: str | None) -> ImageRequest:
    recipe = next(iter(engine.pipe.accel.recipes.values()))
    prompt = prompt_of_warm_length(engine.pipe, recipe, rng, SIZE)  # a text length the warm-up captured
    return ImageRequest(prompt, 1, *SIZE, seed=rng.randrange(10**6), steps=2, lora=lora)


def _replays_without_compiling(engine: Engine, counter: Any, request: ImageRequest) -> np.ndarray:
    """The request's image, checked: nothing compiled or captured, every denoiser call a replay."""
    frames, (replays, eager) = counter.frame_count, engine.denoiser_counts()
    captures = engine.pipe.accel.stats()["transformer"].captures
    got = _image(engine, request)
    after = engine.denoiser_counts()
    assert counter.frame_count == frames, f"adapter {request.lora}: dynamo compiled again after the warm-up"
    assert engine.pipe.accel.stats()["transformer"].captures == captures, f"adapter {request.lora}: captured again"
    assert after[1] == eager and after[0] > replays, f"adapter {request.lora}: a denoiser call ran eagerly"
    return got


def test_loras_warm_up_compiled_and_replay(counter: Any, catalog: tuple[LoraSpec, ...], tmp_path: Path) -> None:
    engine, _ = _engine(catalog, tmp_path / "cache")
    assert warm_up(engine, [SIZE], BUCKETS).captured
    assert counter.frame_count > 8, "fewer versions than dynamo's default limit: this test checks nothing"
    stats = engine.pipe.accel.stats()["transformer"]
    assert stats.evictions == 0 and stats.captures > 32, "the warm-up's graphs fit the library's default: weaker"
    rng = random.Random(random.randrange(10**6))
    base = _request(engine, rng, None)
    images = {}
    # None after each adapter: its state is the warm-up's whichever adapter ran last.
    for lora in ["ink", None, "oil", None]:
        request = ImageRequest(base.prompt, 1, *SIZE, seed=base.seed, steps=2, lora=lora)
        images[lora] = _replays_without_compiling(engine, counter, request)
    assert not np.array_equal(images[None], images["ink"]) and not np.array_equal(images["ink"], images["oil"])


def test_adapter_slots_warm_up_compiled_and_hot_swap(counter: Any, catalog: tuple[LoraSpec, ...],
                                                     tmp_path: Path) -> None:  # fmt: skip
    gum = LoraSpec(make_lora_file("z-image", tmp_path / "gum.safetensors", seed=4), 1.3, "gum")
    catalog = (*catalog, gum)
    engine, prepared = _engine(slot_specs(catalog, 2), tmp_path / "cache")
    slots = AdapterSlots(engine.pipe, catalog, prepared.loras)
    slots.prepare(largest_rank(catalog))
    engine.adapters = slots
    assert warm_up(engine, [SIZE], BUCKETS).captured
    assert engine.pipe.accel.stats()["transformer"].evictions == 0
    rng = random.Random(random.randrange(10**6))
    # None after each slot: its state is the warm-up's whichever slot ran last.
    for name in ["ink", None, "oil", None, "gum", "oil"]:
        if name == "gum":
            slots.release("ink")
        if name is not None:
            slots.load(name, timeout=1)
        _replays_without_compiling(engine, counter, _request(engine, rng, name))
