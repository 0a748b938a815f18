"""The install plan on the CPU: decided in one pass before anything is installed, entered one
layer at a time in its order, and undone in the reverse order (also when an install fails)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

import accel.hooks.install as install_mod
from accel.graphs import patches
from accel.graphs.errors import BCGError
from accel.hooks.graph_hook import graph_hook_of
from accel.hooks.install import Installation
from accel.hooks.options import AcceleratorOptions
from accel.hooks.plan import plan_install
from accel.hooks.recipes.generic import GenericRecipe
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image.recipe import QwenImageRecipe


def _untouched(pipe: Any) -> bool:
    modules = (pipe.transformer, pipe.text_encoder, pipe.vae.decoder)
    return all(graph_hook_of(m) is None and "forward" not in vars(m) for m in modules)


def test_the_plan_names_every_layer_and_installs_nothing() -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    before = patches.active()
    plan = plan_install(pipe, AcceleratorOptions(vae=True, text_encoder=True))
    assert _untouched(pipe) and patches.active() == before and "accel" not in vars(pipe)
    assert [m.name for m in plan.modules] == ["transformer", "text_encoder", "vae.decoder"]
    assert plan.denoisers == ["transformer"]
    transformer, text_encoder, decoder = plan.modules
    assert type(transformer.recipe) is QwenImageRecipe and not transformer.component
    assert all(type(m.recipe) is GenericRecipe and m.component for m in (text_encoder, decoder))
    # The breaks the denoiser's recipe names for a component go with it; the decoder's offload
    # hooks sit on the VAE.
    assert text_encoder.breaks == tuple(transformer.recipe.component_breaks()["text_encoder"])
    assert decoder.offload_root is pipe.vae and text_encoder.offload_root is None
    assert all(m.module is m_ for m, m_ in zip(plan.modules, (pipe.transformer, pipe.text_encoder, pipe.vae.decoder)))
    assert plan.guard and plan.parallel is None and plan.quantization is None
    assert plan.cfg_batch == ()  # on the CPU nothing is joined: the pipeline stays as it is
    assert not any(m.shared for m in plan.modules)
    lines = plan.describe()
    assert lines[0] == (
        "  install plan: transformer (recipe qwen-image), text_encoder (recipe generic, "
        f"{len(text_encoder.breaks)} known break(s)), vae.decoder (recipe generic)"
    )
    assert "call guard on the scheduler" in lines[1] and "graph pool none" in lines[1]
    assert plan_install(pipe, AcceleratorOptions(vae=False, text_encoder=False)).denoisers == ["transformer"]
    assert [m.name for m in plan_install(pipe, AcceleratorOptions(vae=False)).modules] == [
        "transformer",
        "text_encoder",
    ]


def test_a_refusal_comes_from_the_plan_before_anything_is_installed() -> None:
    first = build_pipeline("z-image", "tiny")
    second = type(first)(**first.components)
    installed = Installation(first, plan_install(first, AcceleratorOptions()))
    shared = plan_install(second, AcceleratorOptions())
    assert all(m.shared for m in shared.modules)
    assert shared.modules[0].recipe is graph_hook_of(first.transformer).recipe  # the one in use
    before = patches.active()
    # The text encoder comes after the denoiser: refused all the same, before the denoiser is joined.
    hook = graph_hook_of(first.text_encoder)
    hook.options = dataclasses.replace(hook.options, max_entries=4)
    with pytest.raises(ValueError, match=r"text_encoder .* already accelerated by another pipeline"):
        plan_install(second, AcceleratorOptions())
    assert patches.active() == before
    assert len(graph_hook_of(first.transformer).users) == 1
    installed.uninstall()
    assert _untouched(first)
    no_denoiser = SimpleNamespace(scheduler=first.scheduler)
    with pytest.raises(ValueError, match="has no denoiser to accelerate"):
        plan_install(no_denoiser, AcceleratorOptions())


class _Log:
    """Every layer's way in and out, as the install enters and leaves it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_parallel: bool = False) -> None:
        self.said: list[str] = []
        self.fail_parallel = fail_parallel
        for name in ("apply_graph_runner", "remove_graph_runner", "apply_cfg_batch", "remove_cfg_batch"):
            monkeypatch.setattr(install_mod, name, self._logged(name, getattr(install_mod, name)))
        guard = install_mod.CallGuard
        monkeypatch.setattr(guard, "attach", classmethod(self._logged("attach", guard.attach.__func__)))
        monkeypatch.setattr(guard, "detach", self._logged("detach", guard.detach))
        monkeypatch.setattr(install_mod, "_parallel_session", self._session)

    def _logged(self, what: str, fn: Any) -> Any:
        def logged(*args: Any, **kwargs: Any) -> Any:
            name = kwargs.get("name")
            self.said.append(f"{what} {name}" if name else what)
            return fn(*args, **kwargs)

        return logged

    def _session(self, pipe: Any, denoisers: dict, guard: Any, options: Any) -> Any:
        self.said.append(f"parallel {sorted(denoisers)}")
        if self.fail_parallel:
            raise RuntimeError("a rank disagreed")
        return SimpleNamespace(layout=SimpleNamespace(ulysses=1), restore=lambda: self.said.append("parallel restore"))


class _Quantization:
    def __init__(self, said: list[str]) -> None:
        self.said = said

    def restore(self) -> None:
        self.said.append("quantization restore")


def test_each_layer_is_entered_once_in_order_and_left_in_reverse(monkeypatch) -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    log = _Log(monkeypatch)
    # What the plan decides on a GPU: joined guidance, a parallel session, quantization.
    plan = dataclasses.replace(
        plan_install(pipe, AcceleratorOptions()),
        cfg_batch=("transformer",),
        parallel="ulysses",
        quantization=_Quantization(log.said),
    )
    installed = Installation(pipe, plan)
    assert log.said == [
        "apply_graph_runner transformer",
        "apply_graph_runner text_encoder",
        "apply_graph_runner vae.decoder",
        "attach",
        "parallel ['transformer']",
        "apply_cfg_batch transformer",
    ]
    assert list(installed.hooks) == ["transformer", "text_encoder", "vae.decoder"]
    assert set(installed.cfg_batch) == {"transformer"}
    log.said.clear()
    installed.uninstall()
    assert log.said == [
        "remove_cfg_batch",
        "parallel restore",
        "detach",
        "remove_graph_runner",
        "remove_graph_runner",
        "remove_graph_runner",
        "quantization restore",
    ]
    assert _untouched(pipe)


def test_an_install_that_fails_half_way_leaves_what_it_entered_in_reverse(monkeypatch) -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    before = patches.active()
    log = _Log(monkeypatch, fail_parallel=True)
    plan = dataclasses.replace(plan_install(pipe, AcceleratorOptions(vae=False)), parallel="ulysses")
    with pytest.raises(RuntimeError, match="a rank disagreed"):
        Installation(pipe, plan)
    assert log.said == [
        "apply_graph_runner transformer",
        "apply_graph_runner text_encoder",
        "attach",
        "parallel ['transformer']",
        "detach",
        "remove_graph_runner",
        "remove_graph_runner",
    ]
    assert _untouched(pipe) and patches.active() == before
    # Without accel.parallel imported, parallel= is refused before any layer is entered.
    log.said.clear()
    monkeypatch.setattr(install_mod, "_parallel_session", None)
    with pytest.raises(BCGError, match=r"parallel= needs accel\.parallel"):
        Installation(pipe, plan)
    assert log.said == []
