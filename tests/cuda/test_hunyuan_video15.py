"""HunyuanVideo-1.5's recipe with real CUDA graphs: the tiny model of tests/pipelines, in bf16.

The stock forward's ``if is_t2v:`` and boolean-mask indexing sync with the host, so it cannot be
captured whole; with the recipe it is two segments around one eager break, and replays equal the
stock forward bit for bit for text-to-video and image-to-video calls of one shape.
"""

from __future__ import annotations

import pytest
import torch

from accel import GenericRecipe
from accel.hooks.graph_hook import remove_graph_runner
from pipelines.families.hunyuan_video15.recipe import BREAK_NAME, HunyuanVideo15Recipe
from tests.pipelines.families.test_hunyuan_video15 import CASES, _inputs, _install, _model, _User, use_recipe

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")


def _on_device(inputs: dict) -> dict:
    return {
        k: v.to(DEV, torch.bfloat16 if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


def _bf16_model() -> torch.nn.Module:
    return _model().to(DEV, torch.bfloat16)


@torch.no_grad()
def test_replays_equal_the_stock_forward_on_cuda(monkeypatch) -> None:
    use_recipe(monkeypatch, True)
    model = _bf16_model()
    inputs = [_on_device(_inputs(**case)) for case in CASES]
    want = [model(**i)[0] for i in inputs]
    user = _User()
    hook = _install(model, user)
    try:
        assert isinstance(hook.recipe, HunyuanVideo15Recipe) and hook.active
        got = [model(**i)[0] for i in inputs]
        for case, a, b in zip(CASES, got, want):
            assert torch.equal(a, b), f"{case}: max diff {(a.float() - b.float()).abs().max()}"
        st = hook.runner.stats()
        assert hook.runner.blocked == {}
        assert (st.captures, st.replays, st.eager_calls) == (1, len(CASES), 0)
        assert st.segments_per_entry == [2]
        (entry,) = hook.runner.store.entries.values()
        (chain,) = entry.tree.chains.values()
        assert chain.graph.break_names == [BREAK_NAME]
    finally:
        remove_graph_runner(model, user)


@torch.no_grad()
def test_without_the_recipe_the_capture_fails_on_cuda(monkeypatch) -> None:
    use_recipe(monkeypatch, False)
    model = _bf16_model()
    inputs = _on_device(_inputs(**CASES[0]))
    want = model(**inputs)[0]
    user = _User()
    hook = _install(model, user)
    try:
        assert type(hook.recipe) is GenericRecipe
        assert torch.equal(model(**inputs)[0], want)
        st = hook.runner.stats()
        assert st.captures == 0 and st.capture_failures == 1, hook.runner.blocked
    finally:
        remove_graph_runner(model, user)
