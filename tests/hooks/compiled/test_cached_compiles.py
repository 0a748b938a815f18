"""What dynamo compiles under a step cache: a pipeline with cache-dit's DBCache compiles at warm-up
exactly the graphs the same pipeline compiles without it, all of them in the warm-up's compile pass
(none while or after graphs are captured, which would drop them), and nothing afterwards, on its
computed and its cached steps alike (tiny Z-Image, emulated graphs, ``compile=True`` on the CPU
through tests/helpers/cpu_compile.py).

A float8 + DBCache warm-up took minutes of inductor on a GPU where the same without the cache took
seconds. On the CPU the cache hooks and compile add no compile; what did compile late, with or
without a cache, were the component calls: their denoiser calls take the text encoder's
embeddings, whose rotary table is a view of a longer one (another stride than the warm-up cases'),
so dynamo compiled once more after every graph was captured, and dropped them all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.cpu_compile import compile_on_cpu
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.generate import generate

cache_dit = pytest.importorskip("cache_dit")

SIZES = [(64, 64), (32, 32)]
STEPS = 5
PROMPT = "a lighthouse in a storm"


def _dbcache(pipe: Any) -> None:
    config = cache_dit.DBCacheConfig(
        residual_diff_threshold=100.0,  # lifted: every step its settings allow is cached
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=1,
        max_continuous_cached_steps=2,
    )
    cache_dit.enable_cache(pipe, cache_config=config)


@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    emulate_pipelines(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def counter() -> Any:
        return compile_on_cpu(monkeypatch)

    yield counter
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def _compiles(counter: Any, cached: bool) -> tuple[int, int, Any]:
    """(frames compiled by the warm-up, frames compiled by the calls after it, the pipeline); the
    warm-up compiled everything before its first capture."""
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    if cached:
        _dbcache(pipe)
    accelerate_pipeline(pipe, compile=True)
    assert pipe.accel.hooks["transformer"].compiled
    report = pipe.accel.warmup(SIZES, cfg=False, prompts=[PROMPT], progress=False)
    warm = counter.frame_count
    assert report.capture_passes == 1 and pipe.accel.hooks["transformer"].recompile_drops == 0, report
    for size in SIZES * 2:
        generate(pipe, PROMPT, size=size, steps=STEPS, guidance=0.0)
    return warm, counter.frame_count - warm, pipe


@torch.no_grad()
def test_dbcache_compiles_nothing_beyond_the_uncached_pipeline_on_either_path(compiling) -> None:
    plain_warm, plain_after, plain = _compiles(compiling(), cached=False)
    assert plain.accel.stats()["transformer"].eager_calls == 0
    assert plain.accel.hooks["transformer"].recompile_drops == 0
    plain.accel.restore()
    cached_warm, cached_after, pipe = _compiles(compiling(), cached=True)
    assert plain_warm > 0 and plain_after == 0
    assert (cached_warm, cached_after) == (plain_warm, 0)
    hook = pipe.accel.hooks["transformer"]
    computed, cached = hook.caches.rules[0].counts.total_steps
    assert computed > 0 and cached > 0  # both paths ran, under graphs
    st = pipe.accel.stats()["transformer"]
    assert st.eager_calls == 0 and st.replays > 0 and hook.recompile_drops == 0
    pipe.accel.restore()
