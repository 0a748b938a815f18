"""``attention="fa3"`` on the CPU: the library's backends in diffusers' dispatch
(accel/hooks/attention/backends.py), chosen at install or refused in one line
(accel/hooks/attention/selection.py), under emulated graphs and dynamo, with the fa3-fwd wheel
stood in for (tests/helpers/fake_fa3.py)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from accel import AcceleratorOptions, accelerate_pipeline
from accel.hooks import graph_hook, report
from accel.hooks.attention import backends, fa3
from accel.hooks.recipes.mask_backends import backend_refusal, backends_in_use
from pipelines.builders import build_pipeline, build_transformer
from tests.helpers import fake_fa3
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.fake_fa3 import use_fake_fa3
from tests.helpers.generate import generate


@pytest.fixture
def wheel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_fa3(monkeypatch)
    monkeypatch.setattr(fa3, "_said", set())
    yield
    backends.unregister()


def _pipe(name: str = "qwen-image") -> Any:
    pipe = build_pipeline(name, "tiny", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any, prompt: str = "a lighthouse in a storm", **kw: Any) -> torch.Tensor:
    return generate(pipe, prompt, negative_prompt="blurry", guidance=4.0, steps=2, seed=3, **kw)


def backends_in(model: torch.nn.Module) -> dict[str, int]:
    return {name: len(paths) for name, paths in backends_in_use(model).items()}


def test_registered_backends_are_diffusers_own_names(wheel: None) -> None:
    assert not backends.registered()
    with pytest.raises(ValueError):
        AttentionBackendName(backends.FA3)
    backends.register()
    backends.register()  # once
    for name in backends.BACKENDS:
        member = AttentionBackendName(name)
        assert member.value == name and member in _AttentionBackendRegistry._backends
    t = build_transformer("qwen-image", "tiny", dtype=torch.bfloat16)
    t.set_attention_backend(backends.FA3)  # diffusers' own switch
    assert backends_in(t) == {backends.FA3: 2}
    x = torch.randn(1, 16, t.config.in_channels, dtype=torch.bfloat16)
    text = torch.randn(1, 5, t.config.joint_attention_dim, dtype=torch.bfloat16)
    kwargs = dict(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([0.5]), img_shapes=[(1, 4, 4)])
    with torch.no_grad():
        out = t(**kwargs).sample
        assert len(fake_fa3.calls) == 2  # one per block
        t.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        stock = t(**kwargs).sample
    assert len(fake_fa3.calls) == 2
    torch.testing.assert_close(out.float(), stock.float(), rtol=0, atol=0.05)
    backends.unregister()
    assert not backends.registered()
    with pytest.raises(ValueError):
        AttentionBackendName(backends.FA3)


def test_dynamo_traces_a_block_through_the_backend_in_one_graph(wheel: None) -> None:
    torch._dynamo.reset()
    t = build_transformer("qwen-image", "tiny", dtype=torch.bfloat16)
    undo = backends.set_backend(t, backends.FA3)
    block = t.transformer_blocks[0]
    g = torch.Generator().manual_seed(0)
    dim = t.inner_dim
    args = dict(
        hidden_states=torch.randn(1, 16, dim, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(1, 5, dim, generator=g).bfloat16(),
        encoder_hidden_states_mask=None,
        temb=torch.randn(1, dim, generator=g).bfloat16(),
        image_rotary_emb=t.pos_embed([(1, 4, 4)], max_txt_seq_len=5, device="cpu"),
    )
    with torch.no_grad():
        eager = block(**args)
        compiled = torch.compile(block, backend="eager", fullgraph=True)(**args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    undo()
    assert backends_in(t) == {"native": 2}


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    emulate_pipelines(monkeypatch)
    # The recipe pads only where graphs run on CUDA: here, as there.
    monkeypatch.setattr(graph_hook, "module_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(report, "module_device", lambda m: torch.device("cuda"))
    yield


@torch.no_grad()
def test_attention_fa3_replays_equal_the_same_backend_run_eagerly(wheel: None, graphs: None) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe, attention="fa3", text_buckets=None, capture_on_miss=True, cfg_batch=False)
    assert backends_in(pipe.transformer) == {backends.FA3: 2}
    held = backends.set_backend(stock.transformer, backends.FA3)  # undone when let go of
    assert backends_in(stock.transformer) == {backends.FA3: 2}
    prompts = ["a lighthouse in a storm", "a red fox", "a lighthouse in a storm"]
    for prompt in prompts:
        fake_fa3.calls.clear()
        assert torch.equal(_call(pipe, prompt), _call(stock, prompt))
    runner = pipe.accel.runners["transformer"]
    assert runner.counts.replays > 0 and runner.counts.captures >= 2
    text = pipe.accel.report()
    assert "attention fa3: FlashAttention-3 (fa3-fwd), bf16: lossless, not bit for bit cuDNN's attention" in text
    assert "its attention runs FlashAttention-3 (exact, not bit for bit cuDNN's attention)" in text
    assert "attention=None" in text
    pipe.accel.restore()
    assert backends.FA3 not in backends_in(pipe.transformer)
    held()
    assert backends.FA3 not in backends_in(stock.transformer)


def test_the_padding_gate_finds_that_the_backends_take_key_padding_masks(wheel: None) -> None:
    """diffusers' own FlashAttention-3 refuses every mask (so text would not be padded); the
    library's take a key-padding mask in FA3's seqused form."""
    backends.register()
    assert backend_refusal("_flash_3") is not None
    for name in backends.BACKENDS:
        assert backend_refusal(name) is None


@torch.no_grad()
def test_padded_text_goes_to_the_kernel_as_seqused_keys(wheel: None, graphs: None) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe, attention="fa3", capture_on_miss=True, cfg_batch=False)
    got = _call(pipe)
    assert any(c["seqused_k"] for c in fake_fa3.calls)  # the text padded to its bucket, masked
    again = _call(pipe, "another prompt, of other length than the first one")
    assert pipe.accel.hooks["transformer"].recipe.padding_refused is None
    # Padding changes the kernel's sums (bf16 here): close to the unpadded stock call.
    for out, prompt in (
        (got, "a lighthouse in a storm"),
        (again, "another prompt, of other length than the first one"),
    ):
        ref = _call(stock, prompt)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 0.05


@torch.no_grad()
def test_without_the_wheel_attention_stays_and_one_line_says_why(caplog, graphs: None) -> None:
    pipe = _pipe("z-image")
    before = backends_in(pipe.transformer)
    assert fa3.FA3_MODULE not in sys.modules
    with caplog.at_level(logging.WARNING, logger="accel"):
        accelerate_pipeline(pipe, attention="fa3")
    said = [r.getMessage() for r in caplog.records if "attention=" in r.getMessage()]
    assert said == [
        "attention='fa3' not used: the fa3-fwd wheel is not installed (pip install 'bcg-diffusers[fa3]'); "
        "attention runs as before"
    ]
    assert backends_in(pipe.transformer) == before and not backends.registered()
    assert "attention fa3: not used (the fa3-fwd wheel is not installed" in pipe.accel.report()
    pipe.accel.restore()


def test_on_the_cpu_attention_stays_and_one_line_says_why(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    use_fake_fa3(monkeypatch, cpu=False)
    pipe = _pipe("z-image")
    with caplog.at_level(logging.WARNING, logger="accel"):
        accelerate_pipeline(pipe, attention="fa3")
    said = [r.getMessage() for r in caplog.records if "attention=" in r.getMessage()]
    assert said == [
        "attention='fa3' not used: it needs a CUDA GPU of compute capability 9.x (Hopper); the denoiser is on "
        "cpu; attention runs as before"
    ]
    assert backends.FA3 not in backends_in(pipe.transformer)
    pipe.accel.restore()


def test_z_image_processors_take_the_backend(wheel: None) -> None:
    pipe = _pipe("z-image")
    accelerate_pipeline(pipe, attention="fa3")
    choice = pipe.accel.plan.attention
    assert choice.backend == backends.FA3 and choice.processors == {"transformer": 4}
    assert backends_in(pipe.transformer) == {backends.FA3: 4}
    out = generate(pipe, "a fox", steps=2, seed=1)
    assert fake_fa3.calls and torch.isfinite(out.float()).all()
    pipe.accel.restore()


def test_the_option_refuses_what_it_cannot_be() -> None:
    with pytest.raises(ValueError, match="attention must be None or one of fa3; got 'sdpa'"):
        AcceleratorOptions(attention="sdpa")
    with pytest.raises(ValueError, match="attention='fa3' does not combine with parallel='ulysses' yet"):
        AcceleratorOptions(attention="fa3", parallel="ulysses")
    assert AcceleratorOptions(attention="fa3", parallel="cfg").attention == "fa3"
