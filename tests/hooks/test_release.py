"""An accelerated pipeline the user drops is freed, with or without ``pipe.accel.restore()``:
nothing of the library's (call guards, patches, found breaks) keeps its models alive, and none
of its patches outlives it. On a GPU a leak is the whole pipeline's memory, per pipeline built."""

from __future__ import annotations

import gc
import weakref

import pytest

from accel import accelerate_pipeline
from accel.graphs import patches
from accel.hooks.recipes.recipe import WARMUP_ARGUMENTS
from pipelines import zoo
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.leaks import holder_path


def _model_code(model) -> dict:
    """Every function of the model's classes and of their modules, by where it is bound."""
    import sys

    classes = {c for m in model.modules() for c in type(m).__mro__ if c.__module__.startswith("diffusers")}
    code = {(c, k): v for c in classes for k, v in vars(c).items() if callable(v) or isinstance(v, staticmethod)}
    for mod in {sys.modules[c.__module__] for c in classes}:
        code.update({(mod, k): v for k, v in vars(mod).items() if callable(v)})
    return code


def _model_code_now(stock: dict) -> dict:
    return {(owner, k): vars(owner).get(k) for owner, k in stock}


# HiDream and Lumina2: breaks found at capture; FLUX: plain capture; Wan: a VAE it cannot capture.
@pytest.mark.parametrize("name", ["flux", "hidream", "lumina2", "wan"])
@pytest.mark.parametrize("restore", [True, False], ids=["restored", "dropped"])
def test_a_dropped_accelerated_pipeline_is_freed(name: str, restore: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_pipelines(monkeypatch)
    held = set(patches.active())  # other tests' live pipelines may hold patches of their own
    pipe = zoo.build(name, "tiny")
    stock = _model_code(pipe.transformer)
    denoiser = weakref.ref(pipe.transformer)
    family = zoo.family(name)
    accelerate_pipeline(pipe)
    given = {k: v for k, v in zoo.call_inputs(name, "tiny").items() if k not in WARMUP_ARGUMENTS}
    geo = family.geometry["tiny"]
    frames = {"num_frames": geo.frames} if geo.frames else {}
    pipe.accel.warmup([(geo.width, geo.height)], cfg=family.cfg, call_kwargs=given, progress=False, **frames)
    pipe(**zoo.call_kwargs(name, "tiny", steps=2), output_type="latent")
    if restore:
        pipe.accel.restore()
    del pipe, given
    gc.collect()
    if denoiser() is not None:
        pytest.fail(f"the dropped pipeline's {type(denoiser()).__name__} is still alive:\n  {holder_path(denoiser())}")
    # Its patches went with it: a found break's mark of a model's function does not outlive it.
    assert _model_code_now(stock) == stock
    assert set(patches.active()) <= held


@pytest.fixture
def collector_off():
    """The cyclic collector off: what is freed is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _freed_without_collector(pipe, run) -> tuple[bool, str]:
    denoiser = weakref.ref(pipe.transformer)
    run(pipe)
    del pipe
    alive = denoiser()
    return alive is None, "" if alive is None else holder_path(alive)


# Families whose stock pipeline is freed at del after a call (FLUX.1's and Wan's are not: their
# calls' cache_context gives the transformer a diffusers hook registry, a cycle of diffusers' own).
# HiDream and Lumina2 with breaks found at capture (Lumina2's keyed), SD3 a plain capture.
@pytest.mark.parametrize("name", ["hidream", "lumina2", "sd3"])
def test_a_restored_pipeline_is_freed_at_del_like_a_stock_one(
    name: str, collector_off: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipe.accel.restore(); del pipe`` frees the models at once, as ``del pipe`` does for a
    stock pipeline: on a GPU, ``torch.cuda.empty_cache()`` right after gives the memory back
    without a ``gc.collect()``."""
    emulate_pipelines(monkeypatch)
    family = zoo.family(name)
    geo = family.geometry["tiny"]

    def stock(pipe) -> None:
        pipe(**zoo.call_kwargs(name, "tiny", steps=2), output_type="latent")

    freed, holders = _freed_without_collector(zoo.build(name, "tiny"), stock)
    assert freed, f"a stock {name} pipeline outlives del (the premise of this test):\n  {holders}"

    def accelerated(pipe) -> None:
        accelerate_pipeline(pipe)
        given = {k: v for k, v in zoo.call_inputs(name, "tiny").items() if k not in WARMUP_ARGUMENTS}
        frames = {"num_frames": geo.frames} if geo.frames else {}
        pipe.accel.warmup([(geo.width, geo.height)], cfg=family.cfg, call_kwargs=given, progress=False, **frames)
        pipe(**zoo.call_kwargs(name, "tiny", steps=2), output_type="latent")
        assert pipe.accel.stats()["transformer"].replays > 0
        pipe.accel.restore()

    freed, holders = _freed_without_collector(zoo.build(name, "tiny"), accelerated)
    assert freed, f"a restored {name} pipeline outlives del until the collector runs:\n  {holders}"
