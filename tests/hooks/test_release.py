"""An accelerated pipeline the user drops is freed, with or without ``pipe.accel.restore()``:
nothing of the library's (call guards, patches, found breaks) keeps its models alive, and none
of its patches outlives it. On a GPU a leak is the whole pipeline's memory, per pipeline built."""

from __future__ import annotations

import gc
import weakref

import pytest

from accel import accelerate_pipeline
from accel.graphs import patches
from accel.hooks.recipe import WARMUP_ARGUMENTS
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
