"""The fast paths under ``--batching continuous`` on the CPU, graphs emulated: a LoRA (requests
with and without the adapter in separate running batches, the adapter switched between their
steps, each image bit for bit its pipeline call's at its bucket) and compiled blocks (the warm-up
compiles, serving compiles nothing, the same bits). A step cache decides per pipeline call, so it
is refused for continuous batching in one line; float8 is the GPU test's
(tests/cuda/test_serve_continuous.py).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from pipelines.lora import LoraSpec
from pipelines.serve.config import UsageError, parse_args
from pipelines.serve.schema import ImageRequest
from pipelines.serve.warmup import compiled_graphs
from tests.pipelines.serve import test_buckets, test_continuous
from tests.pipelines.serve.server import make_lora
from tests.pipelines.serve.test_buckets import prompt_of_warm_length
from tests.pipelines.serve.test_continuous import Running, continuous_engine, pixels, static

# The fixtures of those modules, used here too.
compiled = test_buckets.compiled
running = test_continuous.running

SIZE = (32, 32)


def serve_and_check(run: Running, requests: list[ImageRequest], seed: int) -> list[list[np.ndarray]]:
    """``requests`` sent from threads at once (they join running batches as they come), each
    image checked against its pipeline call at its bucket; returns the pixels."""
    works = [None] * len(requests)

    def submit(i: int) -> None:
        works[i] = run.submit(requests[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = [pixels(w.future.result(60)) for w in works]  # all done before the pipeline is called here
    for r, w, mine in zip(requests, works, out):
        assert all(np.array_equal(a, b) for a, b in zip(mine, static(run.engine, r, w.bucket))), f"seed {seed}: {r}"
    return out


def test_a_lora_and_the_base_model_in_separate_batches(
    emulated: pytest.MonkeyPatch, running: list[Running], tmp_path: Path
) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    spec = LoraSpec(path=make_lora(tmp_path), scale=1.0, name="style")
    engine = continuous_engine("z-image", (1, 2, 4), sizes=(SIZE,), loras=(spec,))
    prompt = prompt_of_warm_length(engine.pipe, engine.pipe.accel.recipes["transformer"], rng, SIZE)
    run = Running(engine, 4)
    running.append(run)
    counts = engine.denoiser_counts()
    requests = [ImageRequest(prompt, 1, *SIZE, seed=7, steps=rng.choice((2, 3, 4)), lora=lora)
                for lora in ("style", None, "style", None, None, "style")]  # fmt: skip
    made = serve_and_check(run, requests, seed)
    assert not np.array_equal(made[0][0], made[1][0]) or requests[0].steps != requests[1].steps
    styled = [m for r, m in zip(requests, made) if r.lora and r.steps == requests[0].steps]
    base = [m for r, m in zip(requests, made) if not r.lora and r.steps == requests[0].steps]
    assert all(not np.array_equal(s[0], b[0]) for s in styled for b in base), (
        f"seed {seed}: the adapter changed nothing"
    )
    after = engine.denoiser_counts()
    assert after[1] == counts[1] and after[0] > counts[0], f"seed {seed}: a step ran eagerly"


def test_compiled_blocks_serve_continuously_without_compiling(
    emulated: pytest.MonkeyPatch, running: list[Running], compiled: Path
) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    engine = continuous_engine("z-image", (1, 2), sizes=(SIZE,), compile=True, compile_cache=compiled)
    assert engine.pipe.accel.options.compile
    prompt = prompt_of_warm_length(engine.pipe, engine.pipe.accel.recipes["transformer"], rng, SIZE)
    run = Running(engine, 2)
    running.append(run)
    before = compiled_graphs()
    requests = [ImageRequest(prompt, 1, *SIZE, seed=rng.randrange(10**6), steps=rng.choice((2, 3)),
                             guidance=rng.choice((0.0, 3.0))) for _ in range(5)]  # fmt: skip
    serve_and_check(run, requests, seed)
    assert compiled_graphs() == before, f"seed {seed}: serving compiled again"


@pytest.mark.parametrize("cache", ["fbc", "taylorseer", "magcache"])
def test_a_step_cache_is_refused_for_continuous_batching_in_one_line(cache: str) -> None:
    extra = ["--cache-ratios", "1.0,1.0"] if cache == "magcache" else []
    with pytest.raises(UsageError) as refused:
        parse_args(["--batching", "continuous", "--cache", cache, *extra])
    assert f"--cache {cache} decides per pipeline call" in str(refused.value) and "\n" not in str(refused.value)
    assert parse_args(["--cache", cache, *extra]).settings.cache is not None  # dynamic batching keeps it


def test_a_model_without_a_loop_by_steps_is_refused_before_it_is_built() -> None:
    from pipelines.generation import InputError
    from pipelines.serve.startup import check

    with pytest.raises(InputError) as refused:
        check(parse_args(["--model", "flux.1", "--device", "cpu", "--batching", "continuous"]))
    assert "FluxPipeline's loop is not run a step at a time" in str(refused.value)
    assert "--batching dynamic" in str(refused.value) and "\n" not in str(refused.value)
    check(parse_args(["--model", "qwen-image", "--device", "cpu", "--batching", "continuous"]))
