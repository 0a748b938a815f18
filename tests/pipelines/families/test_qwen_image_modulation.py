"""Qwen-Image's block modulation once per step for both guidance calls
(pipelines/families/qwen_image/modulation.py): bit for bit the same images under emulated graphs,
with the guidance calls apart and joined (cfg_batch), half the modulation products per step, no
reuse across pipeline calls or a weight change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from accel.hooks.cfg_batch import apply_cfg_batch, remove_cfg_batch
from pipelines.builders import build_transformer
from pipelines.families.qwen_image import modulation, recipe
from pipelines.families.qwen_image.modulation import COMPUTE, REUSE, ModulationOnce
from tests.helpers.after_warmup import as_on_cuda, tiny
from tests.helpers.generate import generate

STEPS = 3


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    as_on_cuda(monkeypatch, host_copies=False)
    # The recipe routes calls only where graphs run on CUDA: here, as there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pipe() -> Any:
    return tiny("qwen-image")


def _call(pipe: Any, prompt: str = "a red fox in the snow", steps: int = STEPS) -> torch.Tensor:
    return generate(pipe, prompt, negative_prompt="blurry", guidance=4.0, steps=steps, seed=7)


def _count_products(pipe: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the modulation Linear layers' calls (outside any capture: replays run no Python).
    Through the class, not a hook on the layers: a hook would switch the denoiser's graphs off."""
    mods = {id(m[1]) for b in pipe.transformer.transformer_blocks for m in (b.img_mod, b.txt_mod)}
    counted = [0]
    stock = torch.nn.Linear.forward

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        counted[0] += id(self) in mods
        return stock(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)
    return counted


def test_roles_reuse_only_right_after_the_call_that_computed() -> None:
    once = ModulationOnce(build_transformer("qwen-image", "tiny"))
    undo = once.install()
    hidden = torch.zeros(1, 4, 8)

    def role(t: float, batch: int = 1, dtype: torch.dtype = torch.float32) -> str | None:
        return once.role({"timestep": torch.full((batch,), t), "hidden_states": hidden.to(dtype)})

    assert [role(0.9), role(0.9), role(0.9), role(0.8), role(0.8)] == [COMPUTE, REUSE, COMPUTE, COMPUTE, REUSE]
    assert [role(0.7), role(0.7, batch=2), role(0.7, batch=2)] == [COMPUTE, COMPUTE, REUSE]
    assert [role(0.6), role(0.6, dtype=torch.bfloat16)] == [COMPUTE, COMPUTE]
    assert once.role({"timestep": torch.tensor(0.5), "hidden_states": hidden}) is None
    assert once.role({"timestep": torch.ones(1), "hidden_states": hidden, "guidance": torch.ones(1)}) is None
    undo()
    assert all("forward" not in vars(m) for m in once.mods)


def test_not_applied_where_the_modulation_is_not_the_timesteps_alone() -> None:
    t = build_transformer("qwen-image", "tiny")
    assert ModulationOnce.applies(t)
    t.register_to_config(zero_cond_t=True)
    assert not ModulationOnce.applies(t)


@torch.no_grad()
def test_guidance_calls_apart_read_one_computation_bit_for_bit(graphs: None, monkeypatch) -> None:
    today, once = _pipe(), _pipe()
    with monkeypatch.context() as m:
        m.setattr(recipe, "modulation_once", lambda module: None)
        accelerate_pipeline(today, capture_on_miss=True, cfg_batch=False)
        reference = [_call(today), _call(today, "a lighthouse"), _call(today)]
        assert today.accel.recipes["transformer"].modulation is None
    accelerate_pipeline(once, capture_on_miss=True, cfg_batch=False)
    products = _count_products(once, monkeypatch)
    got = [_call(once), _call(once, "a lighthouse"), _call(once)]
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
    state = once.accel.recipes["transformer"].modulation
    assert state is not None and state.reused == 3 * STEPS
    runner = once.accel.runners["transformer"]
    assert runner.counts.replays > 0 and len(runner.store.entries) >= 2  # a graph per role
    # Counted outside the captures: the eager runs of the first calls only (replays run no hooks).
    assert products[0] > 0
    once.accel.restore()
    assert all("forward" not in vars(b.img_mod) for b in once.transformer.transformer_blocks)


@torch.no_grad()
def test_each_call_computes_in_eager_runs_half_the_products(graphs: None, monkeypatch) -> None:
    """Without graphs (mode debug runs each call eagerly through the runner): the second call of
    a step reads the first one's rows, so a step makes half the products."""
    today = _pipe()
    with monkeypatch.context() as m:
        m.setattr(recipe, "modulation_once", lambda module: None)
        accelerate_pipeline(today, mode="debug", cfg_batch=False)
    pipe = _pipe()
    accelerate_pipeline(pipe, mode="debug", cfg_batch=False)
    blocks = len(pipe.transformer.transformer_blocks)
    products, today_products = _count_products(pipe, monkeypatch), _count_products(today, monkeypatch)
    assert torch.equal(_call(pipe), _call(today))
    assert products[0] == STEPS * 2 * blocks  # img and txt modulation, once per step
    assert today_products[0] == 2 * products[0]  # at both guidance calls
    for p in (pipe, today):
        p.accel.restore()


@torch.no_grad()
def test_joined_guidance_calls_compute_as_before_bit_for_bit(graphs: None, monkeypatch) -> None:
    def joined(pipe: Any) -> list[torch.Tensor]:
        accelerate_pipeline(pipe, capture_on_miss=True)
        hook = pipe.accel.hooks["transformer"]
        apply_cfg_batch(pipe.transformer, hook.recipe, pipe.accel.guard, name="transformer", user=pipe.accel)
        try:
            return [_call(pipe), _call(pipe, "a lighthouse")]
        finally:
            remove_cfg_batch(pipe.transformer, pipe.accel)

    with monkeypatch.context() as m:
        m.setattr(recipe, "modulation_once", lambda module: None)
        reference = joined(_pipe())
    pipe = _pipe()
    got = joined(pipe)
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
    assert pipe.accel.recipes["transformer"].modulation.reused == 0  # one call per step: nothing to reuse


@torch.no_grad()
def test_a_weight_changed_between_calls_is_never_read_stale(graphs: None, monkeypatch) -> None:
    today, once = _pipe(), _pipe()
    with monkeypatch.context() as m:
        m.setattr(recipe, "modulation_once", lambda module: None)
        accelerate_pipeline(today, capture_on_miss=True, cfg_batch=False)
    accelerate_pipeline(once, capture_on_miss=True, cfg_batch=False)
    assert torch.equal(_call(once, steps=2), _call(today, steps=2))
    for p in (once, today):  # in place: the graphs read the new values by address
        p.transformer.transformer_blocks[0].img_mod[1].weight.data.mul_(1.5)
    changed = _call(once, steps=2)
    assert torch.equal(changed, _call(today, steps=2))
    assert once.accel.recipes["transformer"].modulation.reused == 4


@torch.no_grad()
def test_dynamo_traces_a_block_in_both_roles_in_one_graph_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=True compiles whole blocks (fullgraph): the modulation's role is a global dynamo
    guards on, its rows a tensor it takes as an input; no graph break, the same values."""
    torch._dynamo.reset()
    t = build_transformer("qwen-image", "tiny")
    once = ModulationOnce(t)
    undo = once.install()
    block = t.transformer_blocks[0]
    g = torch.Generator().manual_seed(0)
    dim = t.inner_dim
    args = dict(
        hidden_states=torch.randn(1, 16, dim, generator=g),
        encoder_hidden_states=torch.randn(1, 5, dim, generator=g),
        encoder_hidden_states_mask=None,
        temb=torch.randn(1, dim, generator=g),
        image_rotary_emb=t.pos_embed([(1, 4, 4)], max_txt_seq_len=5, device="cpu"),
    )
    stock = block(**args)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    kwargs = {"timestep": torch.ones(1), "hidden_states": args["hidden_states"]}
    for role in (COMPUTE, REUSE):
        assert once.role(kwargs) == role
        monkeypatch.setattr(modulation, "_ROLE", role)
        out = compiled(**args)
        assert all(torch.equal(a, b) for a, b in zip(out, stock, strict=True))
    rows = vars(block.img_mod)["_bcg_modulation_rows"]
    assert torch.equal(rows[:1], block.img_mod[1](torch.nn.functional.silu(args["temb"])))
    undo()
