"""plan_warmup and run_warmup, their CUDA parts faked: every case compiles before any capture, and a
recompile during capture makes it capture every case once more; video cases run largest first
with their frame counts and every call carries the user's call_kwargs; a recipe that cannot
measure prompts warms each one up as given."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import accel.hooks.warmup as warmup_mod
from accel.hooks.recipes.recipe import Recipe, WarmupCase
from accel.hooks.warmup import run_warmup
from accel.hooks.warmup_plan import case_calls, plan_warmup
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

    def stats(self, memory: bool = True, *, pool: bool = True) -> Any:
        return type("Stats", (), {"captures": self.captures, "static_bytes": 0, "boundary_bytes": 0})()


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


class VideoPipe(FakePipe):
    """A FakePipe whose call takes ``num_frames`` (default 81); records frames and extra arguments."""

    def __init__(self, runner: FakeRunner) -> None:
        super().__init__(runner, [0], set())
        self.frames: list[tuple[int, dict[str, Any]]] = []

    def __call__(self, *, width: int, height: int, prompt_length: int, generator: Any, num_frames: int = 81,
                 **kwargs: Any) -> None:  # fmt: skip
        self.frames.append((num_frames, kwargs))
        super().__call__(width=width, height=height, prompt_length=prompt_length, generator=generator)


class LengthRecipe(Recipe):
    name = "lengths"

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict]:
        frames = {"num_frames": case.num_frames} if case.num_frames is not None else {}
        yield dict(width=case.width, height=case.height, prompt_length=case.prompt_length, **frames)


def _plan(recipe: Recipe, pipe: Any, resolutions: list[tuple[int, int]], **kwargs: Any) -> Any:
    request: dict[str, Any] = dict(
        batch_sizes=[1], cfg=False, prompt_lengths=[32, 64], prompts=None, negative_prompt=None, num_inference_steps=2
    )
    return plan_warmup(recipe, pipe, resolutions, **{**request, **kwargs})


@pytest.mark.parametrize("recompile_during_capture", [False, True])
def test_compiled_warmup_compiles_every_case_first_and_captures_again_after_a_recompile(
    monkeypatch: pytest.MonkeyPatch, recompile_during_capture: bool
) -> None:
    compiles = [0]
    monkeypatch.setattr(warmup_mod, "compiled_graph_count", lambda: compiles[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe = LengthRecipe()
    runner = FakeRunner()
    # the compile pass recompiles on its first two calls; the first capture pass once, on its second call
    pipe = FakePipe(runner, compiles, {0, 1} | ({5} if recompile_during_capture else set()))
    plan = _plan(recipe, pipe, [(512, 512), (1024, 1024)])
    cases = [(c.width, c.height, c.text) for c in plan.cases]
    assert cases == [(1024, 1024, 64), (1024, 1024, 32), (512, 512, 64), (512, 512, 32)]  # largest first
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


@pytest.mark.parametrize("compiles_again", [False, True])
def test_a_later_compiled_warmup_that_compiles_captures_the_earlier_ones_again(
    monkeypatch: pytest.MonkeyPatch, compiles_again: bool
) -> None:
    """A second warm-up compiling a new shape drops the first one's graphs (dynamo's newest
    kernels serve every shape): it captures the first one's cases again after its own, so no call
    after the warm-ups captures; one that compiles nothing leaves them as they are."""
    compiles = [0]
    monkeypatch.setattr(warmup_mod, "compiled_graph_count", lambda: compiles[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe, runner = LengthRecipe(), FakeRunner()
    pipe = FakePipe(runner, compiles, {0})
    first = _plan(recipe, pipe, [(512, 512)])
    run_warmup(pipe, recipe, first, [runner], torch.device("cpu"), compiled=True, progress=False)
    pipe.calls.clear()
    pipe.recompile_on = {0} if compiles_again else set()
    second = _plan(recipe, pipe, [(1024, 1024)])
    report = run_warmup(
        pipe, recipe, second, [runner], torch.device("cpu"), compiled=True, progress=False, earlier=[first]
    )
    own = [("capture", c.width, c.height, c.prompt_length) for c in second.cases]
    again = [("capture", c.width, c.height, c.prompt_length) for c in first.cases] if compiles_again else []
    assert [c for c in pipe.calls if c[0] == "capture"] == own + again
    assert report.total_captures == len(own) + len(again)


def test_compiled_components_compile_before_any_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder with compiled kernels (its GroupNorms) compiling size by size while captured gave
    the first size's graph kernels a later size had replaced; its calls now compile first too."""
    monkeypatch.setattr(warmup_mod, "compiled_graph_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe, runner, decoder = LengthRecipe(), FakeRunner(), FakeRunner()
    pipe = FakePipe(runner, [0], set())
    pipe.components = {}  # no text encoder: the component calls decode only
    plan = _plan(recipe, pipe, [(512, 512), (1024, 1024)])
    run_warmup(
        pipe,
        recipe,
        plan,
        [runner, decoder],
        torch.device("cpu"),
        compiled=True,
        progress=False,
        components=[decoder],
    )
    phases = [p for p, *_ in pipe.calls]
    cases, sizes = len(plan.cases), 2  # each size's first case decodes once more for the components
    # The component calls compile too (the denoiser on real embeddings), before any capture.
    assert phases == ["eager"] * (cases + sizes) + ["capture"] * (cases + sizes)


def test_uncompiled_warmup_captures_each_case_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe, runner = LengthRecipe(), FakeRunner()
    pipe = FakePipe(runner, [0], set())
    plan = _plan(recipe, pipe, [(512, 512)])
    report = run_warmup(pipe, recipe, plan, [runner], torch.device("cpu"), compiled=False, progress=False)
    assert [p for p, *_ in pipe.calls] == ["capture", "capture"]
    assert report.compiled_graphs == 0 and report.total_captures == 2


def test_video_cases_run_largest_first_with_their_frames_and_the_call_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recipe, runner = LengthRecipe(), FakeRunner()
    pipe = VideoPipe(runner)
    extra = {"max_sequence_length": 16, "attention_kwargs": {"scale": 0.5}}
    plan = _plan(recipe, pipe, [(512, 512), (1024, 1024)], prompt_lengths=[32], num_frames=[9, 33], call_kwargs=extra)
    # pixels x frames: 1024*1024*33 > 1024*1024*9 > 512*512*33 > 512*512*9
    assert plan.sizes == [(1024, 1024, 33), (1024, 1024, 9), (512, 512, 33), (512, 512, 9)]
    report = run_warmup(pipe, recipe, plan, [runner], torch.device("cpu"), compiled=False, progress=False)
    assert [f for f, _ in pipe.frames] == [33, 9, 33, 9]
    assert all(kwargs == extra for _, kwargs in pipe.frames)  # merged into every call
    assert [(r.width, r.height, r.frames) for r in report.rows] == plan.sizes
    lines = str(report).splitlines()
    assert lines[0].split()[:2] == ["resolution", "frames"] and lines[1].split()[:2] == ["1024x1024", "33"]

    default = _plan(recipe, pipe, [(512, 512)])
    assert [c.num_frames for c in default.cases] == [81, 81]  # the call's own default
    images = FakePipe(runner, [0], set())
    assert [c.num_frames for c in _plan(recipe, images, [(512, 512)]).cases] == [None, None]
    with pytest.raises(ValueError, match="FakePipe makes images, its call takes no num_frames"):
        _plan(recipe, images, [(512, 512)], num_frames=9)


class PromptRecipe(LengthRecipe):
    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict]:
        for call in super().warmup_calls(pipe, case):
            yield {**call, "prompt": case.prompt}


def test_a_recipe_that_cannot_measure_prompts_warms_each_up_as_given() -> None:
    recipe = PromptRecipe()  # its prompt_lengths is the base one: NotImplementedError
    pipe = FakePipe(FakeRunner(), [0], set())
    prompts = ["a red fox", "a lighthouse at night", "a red fox"]
    plan = _plan(recipe, pipe, [(512, 512)], prompt_lengths=None, prompts=prompts, cfg=[True, False])
    assert [(c.cfg, c.text) for c in plan.cases] == [
        (True, "a red fox"),
        (True, "a lighthouse at night"),
        (False, "a red fox"),
        (False, "a lighthouse at night"),
    ]
    assert plan.cases[0].negative_prompt_length is None
    calls = list(case_calls(recipe, pipe, plan.cases[1]))
    assert calls == [dict(width=512, height=512, prompt_length=None, prompt="a lighthouse at night")]


def test_the_components_are_captured_at_every_batch_size() -> None:
    """A server's buckets 1, 2 and 4 at one size once gave the components a call at the first case
    only (the largest batch): at the smaller buckets the text encoder and the VAE decoder ran
    eagerly in every request."""
    recipe, runner = LengthRecipe(), FakeRunner()
    pipe = FakePipe(runner, [0], set())
    pipe.components = {}  # no text encoder: the component calls decode only
    plan = _plan(recipe, pipe, [(512, 512), (256, 256)], batch_sizes=[1, 2, 4])
    calls = list(warmup_mod._component_calls(recipe, pipe, plan, ["a fox"], None))
    batches = {case.batch_size for case in plan.cases}
    assert batches == {1, 2, 4}
    assert len(calls) == len(batches) * 2 and {size for size, _ in calls} == {(512, 512, None), (256, 256, None)}
    assert all(kwargs["output_type"] == "pil" for _, kwargs in calls)


class PeakPipe(FakePipe):
    """A FakePipe whose captures grow the pool and measure an eager peak, by resolution, and
    whose decoder (on its own pool) measures a larger one at the largest size."""

    def __init__(self, runner: FakeRunner, decoder: FakeRunner) -> None:
        super().__init__(runner, [0], set())
        self.decoder = decoder
        self.giving_back: list[bool] = []

    def __call__(self, *, width: int, height: int, prompt_length: int, generator: Any, **kwargs: Any) -> None:
        super().__call__(width=width, height=height, prompt_length=prompt_length, generator=generator)
        self.giving_back.append(self.runner.pool.give_back_before_capture)
        if self.runner.capturing_depth:
            FakePool.resident += width * 1024  # the pool grows by what the capture allocated
            self.runner.pool.eager_peak = max(self.runner.pool.eager_peak, width * 4096)
            if "output_type" in kwargs:  # a component call decodes
                self.decoder.pool.eager_peak = width * 8192 if width == 1024 else 1


def test_each_resolution_shows_the_graph_memory_it_added_beside_the_eager_peak_it_replaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    FakePool.resident = 0
    recipe, runner, decoder = LengthRecipe(), FakeRunner(), FakeRunner()
    released: list[int] = []
    monkeypatch.setattr(FakePool, "release_cached", lambda self: released.append(1) or 0)
    pipe = PeakPipe(runner, decoder)
    pipe.components = {}
    plan = _plan(recipe, pipe, [(512, 512), (1024, 1024)])
    report = run_warmup(
        pipe, recipe, plan, [runner, decoder], torch.device("cpu"), compiled=False, progress=False, components=[decoder]
    )
    rows = {r.width: r for r in report.rows}
    assert rows[1024].resident_bytes == 3 * 1024 * 1024 and rows[512].resident_bytes == 3 * 512 * 1024
    # The largest of what every pool's captures measured in the row: the decoder's at 1024.
    assert rows[1024].eager_peak_bytes == 1024 * 8192 and rows[512].eager_peak_bytes == 512 * 4096
    assert report.largest_eager_peak_bytes == 1024 * 8192
    text = str(report)
    assert "eager peak MiB" in text and f"{1024 * 8192 / 2**20:14.1f}" in text
    # The cache was given back before every capture during the warm-up, and once more at its end.
    assert pipe.giving_back and all(pipe.giving_back) and not runner.pool.give_back_before_capture and released
