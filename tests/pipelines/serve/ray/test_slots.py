"""Adapter slots (pipelines/serve/ray/slots.py) with CUDA graphs emulated on the CPU: loading an
adapter into a warm replica is a hot-swap that captures nothing (every later denoiser call a
replay of the slot's warm-up graphs), and its image equals bcg-serve's with that adapter loaded
the ordinary way, bit for bit, at scales other than 1 too; an evicted adapter's slot is reused
only once no request needs it; an adapter that cannot be swapped in stops the start in one line.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from pipelines.generation import ModelSettings, Workload, prepare_pipeline, resolve_device_and_dtype
from pipelines.lora import LoraError, LoraSpec
from pipelines.serve.engine import Engine
from pipelines.serve.ray.slots import AdapterSlots, NoSlot, largest_rank, slot_specs
from pipelines.serve.schema import ImageRequest
from pipelines.serve.warmup import warm_up
from tests.helpers.lora_files import make_lora_file
from tests.pipelines.serve.server import decode
from tests.pipelines.serve.test_buckets import prompt_of_warm_length

SIZE = (32, 32)
BUCKETS = (1, 2)


def _prepared(loras: tuple[LoraSpec, ...]) -> object:
    s = ModelSettings(model="z-image", device="cpu", warmup=(), loras=loras)
    device, dtype = resolve_device_and_dtype(s)
    return prepare_pipeline(s, Workload(resolutions=[SIZE], prompts=("x",)), device, dtype, progress=False)


def slotted(catalog: tuple[LoraSpec, ...], k: int, graphs: bool = True) -> tuple[Engine, AdapterSlots]:
    prepared = _prepared(slot_specs(catalog, k))
    engine = Engine(prepared, BUCKETS)
    slots = AdapterSlots(engine.pipe, catalog, prepared.loras)
    slots.prepare(largest_rank(catalog))
    engine.adapters = slots
    assert warm_up(engine, [SIZE], BUCKETS).captured == graphs
    return engine, slots


def plain(catalog: tuple[LoraSpec, ...]) -> Engine:
    engine = Engine(_prepared(catalog), BUCKETS)
    assert warm_up(engine, [SIZE], BUCKETS).captured
    return engine


def image(engine: Engine, request: ImageRequest) -> np.ndarray:
    (made,) = engine.run([engine.plan(request)])
    return np.asarray(decode(made[0].b64_json))


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoraSpec, ...]:
    folder = tmp_path_factory.mktemp("loras")
    return (
        LoraSpec(make_lora_file("z-image", folder / "ink.safetensors", seed=2), 1.0, "ink"),
        LoraSpec(make_lora_file("z-image", folder / "oil.safetensors", seed=3, alpha=4), 0.7, "oil"),
        LoraSpec(make_lora_file("z-image", folder / "gum.safetensors", seed=4), 1.3, "gum"),
    )


def test_a_hot_swapped_adapter_replays_the_slot_graphs_and_equals_the_adapter_loaded(
    emulated: pytest.MonkeyPatch, catalog: tuple[LoraSpec, ...]
) -> None:
    engine, slots = slotted(catalog, 2)
    reference = plain(catalog)
    recipe = next(iter(engine.pipe.accel.recipes.values()))
    rng = random.Random(random.randrange(10**6))
    captures = engine.pipe.accel.stats()["transformer"].captures
    # ink and oil into the two slots, then gum into ink's once ink is let go: three swaps.
    order = [("ink", True), ("oil", True), ("ink", False), ("gum", True), ("oil", False), ("gum", False)]
    images: dict[str, np.ndarray] = {}
    for name, swapped in order:
        if name == "gum":
            slots.release("ink")
        slot, did = slots.load(name, timeout=1)
        assert did == swapped, f"{name}: swapped {did}"
        replays, eager = engine.denoiser_counts()
        prompt = prompt_of_warm_length(engine.pipe, recipe, rng, SIZE)
        request = ImageRequest(prompt, 1, *SIZE, seed=rng.randrange(10**6), steps=2, lora=name)
        got = image(engine, request)
        after = engine.denoiser_counts()
        assert after[1] == eager and after[0] > replays, f"{name} in {slot}: a call ran eagerly"
        want = image(reference, request)
        assert np.array_equal(got, want), f"{name} (scale {slots.specs(name)[0].scale}) differs from its plain load"
        images[name] = got
    assert engine.pipe.accel.stats()["transformer"].captures == captures, "a hot-swap was captured again"
    assert slots.loads == {"ink": 1, "oil": 1, "gum": 1}
    # The adapters change the image (the check above could fail), and no adapter is none.
    base = image(engine, ImageRequest("a fox", 1, *SIZE, seed=5, steps=2))
    assert not np.array_equal(base, image(engine, ImageRequest("a fox", 1, *SIZE, seed=5, steps=2, lora="gum")))
    assert np.array_equal(base, image(reference, ImageRequest("a fox", 1, *SIZE, seed=5, steps=2)))


def test_a_released_slot_waits_for_its_requests(catalog: tuple[LoraSpec, ...]) -> None:
    _, slots = slotted(catalog[:2], 1, graphs=False)
    assert slots.load("ink", timeout=1) == ("slot0", True)
    # Its swap is due (the device worker's next call makes it): counted already, and once.
    assert (slots.loads_of("ink"), slots.loads_of("oil")) == (1, 0)
    slots.select("ink")
    assert (slots.loads_of("ink"), slots.loads) == (1, {"ink": 1})
    slots.pin("ink")
    slots.release("ink")
    with pytest.raises(NoSlot, match=r"no adapter slot of this replica came free within 0\.2 s"):
        slots.load("oil", timeout=0.2)
    # ink comes back to its own slot without a swap while its request still holds it.
    assert slots.load("ink", timeout=1) == ("slot0", False)
    slots.release("ink")
    threading.Timer(0.2, slots.unpin, args=("ink",)).start()
    assert slots.load("oil", timeout=5) == ("slot0", True)
    assert slots.holding() == {"slot0": "oil"}


def test_an_adapter_that_cannot_be_swapped_in_stops_the_start(tmp_path: Path) -> None:
    wide = LoraSpec(make_lora_file("z-image", tmp_path / "wide.safetensors", targets=("to_q", "to_k")), 1.0, "wide")
    other = LoraSpec(make_lora_file("z-image", tmp_path / "other.safetensors", targets=("to_out.0",)), 1.0, "other")
    with pytest.raises(LoraError, match=r"'.*other.safetensors' cannot be hot-swapped into the adapter slots made "
                       r"from 'wide.safetensors'"):  # fmt: skip
        slotted((wide, other), 1, graphs=False)
