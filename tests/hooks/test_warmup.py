"""run_warmup with compiled blocks, its CUDA parts faked: every case compiles before any capture,
and a recompile during capture makes it capture every case once more."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import accel.hooks.warmup as warmup_mod
from accel.hooks.recipe import Recipe
from accel.hooks.warmup import plan_warmup, run_warmup
from tests.helpers.fakes import FakePool


class FakeRunner:
    """What run_warmup reads of a runner, and whether it is capturing when the pipe is called."""

    def __init__(self) -> None:
        self.enabled = True
        self.pool = FakePool()
        self.capturing_depth = 0
        self.captures = 0

    @contextlib.contextmanager
    def capturing(self) -> Iterator[FakeRunner]:
        self.capturing_depth += 1
        try:
            yield self
        finally:
            self.capturing_depth -= 1

    def stats(self, memory: bool = True) -> Any:
        return type("Stats", (), {"captures": self.captures})()


class FakePipe:
    """Records each call as (phase, width, height, text length); a call may 'recompile'."""

    def __init__(self, runner: FakeRunner, compiles: list[int], recompile_on: set[int]) -> None:
        self.runner, self.compiles, self.recompile_on = runner, compiles, recompile_on
        self.calls: list[tuple[str, int, int, int]] = []
        self._progress_bar_config: dict[str, Any] = {}

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self._progress_bar_config = kwargs

    def __call__(self, *, width: int, height: int, prompt_length: int, generator: Any, **_: Any) -> None:
        phase = "capture" if self.runner.capturing_depth and self.runner.enabled else "eager"
        if phase == "capture":
            self.runner.captures += 1
        if len(self.calls) in self.recompile_on:
            self.compiles[0] += 1
        self.calls.append((phase, width, height, prompt_length))


class LengthRecipe(Recipe):
    name = "lengths"

    def warmup_calls(self, pipe: Any, *, width: int, height: int, prompt_length: int, **_: Any) -> Iterator[dict]:
        yield dict(width=width, height=height, prompt_length=prompt_length)


def _plan(recipe: Recipe, resolutions: list[tuple[int, int]]) -> Any:
    return plan_warmup(
        recipe,
        None,
        resolutions,
        batch_sizes=[1],
        cfg=False,
        prompt_lengths=[32, 64],
        prompts=None,
        negative_prompt=None,
        num_inference_steps=2,
    )


@pytest.mark.parametrize("recompile_during_capture", [False, True])
def test_compiled_warmup_compiles_every_case_first_and_captures_again_after_a_recompile(
    monkeypatch: pytest.MonkeyPatch, recompile_during_capture: bool
) -> None:
    compiles = [0]
    monkeypatch.setattr(warmup_mod, "compiled_graph_count", lambda: compiles[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe = LengthRecipe()
    runner = FakeRunner()
    plan = _plan(recipe, [(512, 512), (1024, 1024)])
    cases = [(w, h, n) for (w, h, _, _, n) in plan.cases]
    assert cases == [(1024, 1024, 64), (1024, 1024, 32), (512, 512, 64), (512, 512, 32)]  # largest first
    # the compile pass recompiles on its first two calls; the first capture pass once, on its second call
    pipe = FakePipe(runner, compiles, {0, 1} | ({5} if recompile_during_capture else set()))
    report = run_warmup(pipe, recipe, plan, [runner], torch.device("cpu"), compiled=True, progress=False)

    phases = [(p, w, h, n) for p, w, h, n in pipe.calls]
    assert phases[:4] == [("eager", *c) for c in cases]  # every case compiles before any capture
    passes = 2 if recompile_during_capture else 1
    assert phases[4:] == [("capture", *c) for c in cases] * passes
    assert runner.enabled  # switched back on after the compile pass
    assert report.compiled_graphs == compiles[0] == (3 if recompile_during_capture else 2)
    assert [(r.width, r.height) for r in report.rows] == [(1024, 1024), (512, 512)]
    assert all(r.compile_seconds > 0 for r in report.rows)
    # Graphs kept, not captures made: a second pass replaces the first pass's graphs.
    assert report.total_captures == 4 and report.capture_passes == passes
    assert ("every case captured 2 times" in str(report)) == recompile_during_capture


def test_uncompiled_warmup_captures_each_case_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe, runner = LengthRecipe(), FakeRunner()
    plan = _plan(recipe, [(512, 512)])
    pipe = FakePipe(runner, [0], set())
    report = run_warmup(pipe, recipe, plan, [runner], torch.device("cpu"), compiled=False, progress=False)
    assert [p for p, *_ in pipe.calls] == ["capture", "capture"]
    assert report.compiled_graphs == 0 and report.total_captures == 2
