"""accel.hooks.cfg_batch on the CPU: true CFG's two denoiser calls joined into one batch.

accelerate_pipeline installs the hook only where graphs run (CUDA); here it is applied by hand
to a tiny Qwen-Image pipeline, whose recipe pads and joins the two calls itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.cfg_batch import CFGBatchHook, apply_cfg_batch, cfg_batch_hook_of, remove_cfg_batch
from accel.hooks.graph_hook import graph_hook_of
from pipelines.builders import build_pipeline
from pipelines.families.qwen_image.recipe import BUCKET_MAX_IMAGE_TOKENS, QwenImageRecipe
from tests.helpers.generate import generate


def _call(pipe: Any, **kw: Any) -> torch.Tensor:
    return generate(pipe, "a red fox in the snow", negative_prompt="blurry", steps=3, guidance=4.0, seed=7, **kw)


@pytest.fixture(scope="module")
def qwen() -> Any:
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextlib.contextmanager
def _batched(pipe: Any, **options: Any) -> Iterator[CFGBatchHook]:
    """The pipeline accelerated with ``options`` and the hook applied as on a GPU; undone after."""
    accelerate_pipeline(pipe, **options)
    graph_hook = graph_hook_of(pipe.transformer)
    assert graph_hook is not None
    try:
        yield apply_cfg_batch(
            pipe.transformer, graph_hook.recipe, pipe.accel.guard, name="transformer", user=pipe.accel
        )
    finally:
        remove_cfg_batch(pipe.transformer, pipe.accel)
        pipe.accel.restore()


def test_not_installed_without_cuda(qwen: Any) -> None:
    accelerate_pipeline(qwen)
    assert cfg_batch_hook_of(qwen.transformer) is None  # the CPU pipeline stays unchanged
    qwen.accel.restore()
    with pytest.raises(ValueError, match="cfg_batch must be True or False"):
        accelerate_pipeline(qwen, cfg_batch="yes")


def test_joined_pair_equals_two_calls(qwen: Any) -> None:
    reference = _call(qwen)
    unguided = _call(qwen, true_cfg_scale=1.0)
    with _batched(qwen) as hook:
        out = _call(qwen)
        assert (hook.joined, hook.alone) == (3, 0)
    assert cfg_batch_hook_of(qwen.transformer) is None
    # Padding and the batch change the summation order only (fp32 here, bf16 noise on a GPU).
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    assert (reference - unguided).abs().max() > 100 * (out - reference).abs().max()


def test_two_images_per_prompt_join_into_a_batch_of_four(qwen: Any) -> None:
    reference = _call(qwen, num_images_per_prompt=2)
    with _batched(qwen) as hook:
        out = _call(qwen, num_images_per_prompt=2)
        assert (hook.joined, hook.alone) == (3, 0)
    assert out.shape[0] == 2 and not torch.equal(out[0], out[1])
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


def test_first_branch_without_a_second_is_computed_before_the_step(qwen: Any) -> None:
    """Without guidance each step makes one call under cache_context("cond"): it waits for a
    pair that never comes, and is computed before the scheduler reads it, unchanged."""
    reference = _call(qwen, true_cfg_scale=1.0)
    with _batched(qwen) as hook:
        out = _call(qwen, true_cfg_scale=1.0)
        assert (hook.joined, hook.alone) == (0, 3)
    assert torch.equal(out, reference)


def test_exact_text_lengths_are_never_joined(qwen: Any) -> None:
    """text_buckets=None promises eager's output bit for bit: the pair runs as two calls."""
    reference = _call(qwen)
    with _batched(qwen, text_buckets=None) as hook:
        out = _call(qwen)
        assert (hook.joined, hook.alone) == (0, 3)
    assert torch.equal(out, reference)


def test_a_pair_left_by_a_failed_call_is_dropped(qwen: Any) -> None:
    with _batched(qwen) as hook:

        def fail(*a: Any, **k: Any) -> None:
            if qwen.transformer._diffusers_hook.get_hook("bcg_cfg_batch").context.name == "uncond":
                raise RuntimeError("boom")

        handle = qwen.transformer.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            _call(qwen)
        handle.remove()
        assert hook._pending is not None  # the first branch of the failed step
        reference_joined = hook.joined
        _call(qwen)  # the new call drops it where it begins
        assert hook.joined == reference_joined + 3


def test_direct_calls_outside_a_pipeline_call_run_as_they_are(qwen: Any) -> None:
    """A denoiser called by the user's own loop under cache_context("cond") gets its output."""
    seen: list[dict[str, Any]] = []
    handle = qwen.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(dict(k)), with_kwargs=True)
    try:
        _call(qwen)
    finally:
        handle.remove()
    kwargs = {**seen[0], "return_dict": False}
    with torch.no_grad():
        reference = qwen.transformer(**kwargs)[0]
    with _batched(qwen) as hook:
        with torch.no_grad(), qwen.transformer.cache_context("cond"):
            out = qwen.transformer(**kwargs)[0]
        assert (hook.joined, hook.alone) == (0, 0)
    assert torch.equal(out, reference)


def test_pipelines_sharing_the_denoiser_but_not_the_scheduler(qwen: Any) -> None:
    """Each pipeline's guard tells the shared hook where its calls begin, step and end: a call
    without guidance through the second pipeline is computed before its own scheduler steps."""
    import copy

    other = type(qwen)(**{**qwen.components, "scheduler": copy.deepcopy(qwen.scheduler)})
    other.set_progress_bar_config(disable=True)
    reference = _call(other, true_cfg_scale=1.0)
    guided = _call(other)
    with _batched(qwen) as hook, _batched(other) as second:
        assert second is hook and other.accel.guard is not qwen.accel.guard
        assert torch.equal(_call(other, true_cfg_scale=1.0), reference)
        assert (hook.joined, hook.alone) == (0, 3)
        torch.testing.assert_close(_call(other), guided, rtol=1e-4, atol=1e-4)
        assert hook.joined == 3
        remove_cfg_batch(qwen.transformer, qwen.accel)  # the first pipeline lets go
        assert cfg_batch_hook_of(other.transformer) is hook  # the other one still uses it
    assert cfg_batch_hook_of(qwen.transformer) is None
    assert cfg_batch_hook_of(qwen.transformer) is None


def _kwargs(text: int, image: int = 16, *, mask: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(text)
    out: dict[str, Any] = {
        "hidden_states": torch.randn(1, image, 8, generator=g),
        "timestep": torch.tensor([0.5]),
        "guidance": None,
        "encoder_hidden_states": torch.randn(1, text, 4, generator=g),
        "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long) if mask else None,
        "img_shapes": [[(1, 4, 4)]],
        "attention_kwargs": None,
        "return_dict": False,
    }
    return out


def test_recipe_joins_two_texts_at_the_larger_bucket() -> None:
    recipe = QwenImageRecipe()
    joined = recipe.batch_cfg(torch.nn.Identity(), [((), _kwargs(5)), ((), _kwargs(70, mask=True))])
    assert joined is not None and joined[0] == ()
    kw = joined[1]
    first, second = _kwargs(5), _kwargs(70)
    assert kw["encoder_hidden_states"].shape == (2, 128, 4)
    assert torch.equal(kw["encoder_hidden_states"][0, :5], first["encoder_hidden_states"][0])
    assert torch.equal(kw["encoder_hidden_states"][1, :70], second["encoder_hidden_states"][0])
    assert not kw["encoder_hidden_states"][0, 5:].any() and not kw["encoder_hidden_states"][1, 70:].any()
    assert kw["encoder_hidden_states_mask"].sum(1).tolist() == [5, 70]
    assert torch.equal(kw["hidden_states"], torch.cat([first["hidden_states"], second["hidden_states"]]))
    assert kw["timestep"].tolist() == [0.5, 0.5] and kw["img_shapes"] == [[(1, 4, 4)], [(1, 4, 4)]]
    assert kw["guidance"] is None and kw["return_dict"] is False


def test_ulysses_ranks_join_what_one_gpu_keeps_apart() -> None:
    # Each of 2 Ulysses ranks computes half of a 1024x1024 image's tokens: launch-bound again.
    recipe, tokens = QwenImageRecipe(), 2 * BUCKET_MAX_IMAGE_TOKENS
    calls = [((), _kwargs(5, tokens)), ((), _kwargs(70, tokens))]
    assert recipe.batch_cfg(torch.nn.Identity(), calls) is None
    joined = recipe.batch_cfg(torch.nn.Identity(), calls, degree=2)
    assert joined is not None and joined[1]["hidden_states"].shape[:2] == (2, tokens)
    assert joined[1]["encoder_hidden_states"].shape == (2, 128, 4)
    over = [((), _kwargs(5, tokens + 1)), ((), _kwargs(70, tokens + 1))]
    assert recipe.batch_cfg(torch.nn.Identity(), over, degree=2) is None


def test_one_hook_per_module_and_degree(qwen: Any) -> None:
    with _batched(qwen), pytest.raises(ValueError, match="already joined for 1 Ulysses rank"):
        apply_cfg_batch(qwen.transformer, graph_hook_of(qwen.transformer).recipe, qwen.accel.guard,
                        name="transformer", user=object(), degree=2)  # fmt: skip


@pytest.mark.parametrize(
    "why, second",
    [
        ("image above the padded sizes", _kwargs(5, BUCKET_MAX_IMAGE_TOKENS + 1)),
        ("other image shape", _kwargs(5, 32)),
        ("text longer than every bucket", _kwargs(2000)),
        ("unknown tensor argument", {**_kwargs(5), "attention_kwargs": {"scale": torch.ones(1)}}),
        ("other setting", {**_kwargs(5), "return_dict": True}),
    ],
)
def test_recipe_refuses_what_it_cannot_join(why: str, second: dict[str, Any]) -> None:
    recipe = QwenImageRecipe()
    first = _kwargs(5, second["hidden_states"].shape[1]) if why == "image above the padded sizes" else _kwargs(5)
    assert recipe.batch_cfg(torch.nn.Identity(), [((), first), ((), second)]) is None, why
    assert (
        QwenImageRecipe(text_buckets=None).batch_cfg(torch.nn.Identity(), [((), _kwargs(5)), ((), _kwargs(5))]) is None
    )
