"""The state guard on real CUDA graphs: changes after a capture, LoRA switching and hot-swap.

The CPU twins (tests/hooks/state/test_guards.py, tests/hooks/state/test_lora.py) run on emulated graphs; here
the graphs are CUDA's, the weights bf16 on the device, and PEFT's hot-swap scales are one-element
device tensors a replay must read where they are.
"""

from __future__ import annotations

import pytest
import torch

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline, build_transformer
from tests.helpers.generate import generate

pytestmark = pytest.mark.cuda

DEV = "cuda"
PROMPT = "a lighthouse in a storm"


def _pipe(name: str):
    pipe = build_pipeline(name, "tiny", device=DEV, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe):
    return generate(pipe, PROMPT, size=(128, 128), steps=3, seed=0, device=DEV, guidance=4.0, negative_prompt="blurry")


def _eager(pipe):
    runner = pipe.accel.runners["transformer"]
    runner.enabled = False
    try:
        return _call(pipe)
    finally:
        runner.enabled = True


def _warm(pipe) -> None:
    accelerate_pipeline(pipe, capture_on_miss=True)
    pipe.accel.warmup((128, 128), prompts=[PROMPT], negative_prompt="blurry", progress=False)
    _call(pipe)


def _lora_file(name: str, seed: int) -> dict[str, torch.Tensor]:
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    t = build_transformer(name, "tiny")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    t.add_adapter(config, adapter_name="x")
    sd = get_peft_model_state_dict(t, adapter_name="x")
    return {f"transformer.{k}": v.to(DEV, torch.bfloat16) for k, v in sd.items()}


@pytest.mark.parametrize("name", ["z-image", "qwen-image"])
@torch.no_grad()
def test_processor_and_backend_changes_replay_what_eager_runs(name: str, monkeypatch) -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    pipe = _pipe(name)
    _warm(pipe)
    before = _call(pipe)
    st0 = pipe.accel.stats()["transformer"]
    pipe.transformer.set_attention_backend("_native_math")  # the math kernel, not flash or cuDNN
    got = _call(pipe)
    st1 = pipe.accel.stats()["transformer"]
    assert st1.captures > st0.captures and st1.eager_calls == st0.eager_calls  # its own graphs
    assert torch.equal(got, _eager(pipe)) and not torch.equal(got, before)
    for m in pipe.transformer.modules():
        if "processor" in vars(m):
            m.processor.note = "edited"  # an attribute added in place: another state
    again = _call(pipe)
    assert torch.equal(again, _eager(pipe)) and torch.equal(again, got)
    assert pipe.accel.stats()["transformer"].captures > st1.captures
    pipe.accel.restore()


@pytest.mark.parametrize("name", ["z-image", "qwen-image"])
@torch.no_grad()
def test_hot_swap_on_the_device_needs_no_capture_and_equals_eager(name: str) -> None:
    first, second = _lora_file(name, 1), _lora_file(name, 2)
    pipe = _pipe(name)
    pipe.enable_lora_hotswap(target_rank=8)
    pipe.load_lora_weights(first, adapter_name="style")
    _warm(pipe)
    with_first = _call(pipe)
    assert torch.equal(with_first, _eager(pipe))
    captures = pipe.accel.stats()["transformer"].captures
    pipe.load_lora_weights(second, adapter_name="style", hotswap=True)
    with_second = _call(pipe)
    assert not torch.equal(with_second, with_first)
    assert torch.equal(with_second, _eager(pipe))
    pipe.load_lora_weights(first, adapter_name="style", hotswap=True)
    assert torch.equal(_call(pipe), with_first)
    assert pipe.accel.stats()["transformer"].captures == captures
    pipe.accel.restore()


@torch.no_grad()
def test_switching_adapters_back_replays_kept_graphs() -> None:
    name = "z-image"
    a, b = _lora_file(name, 1), _lora_file(name, 2)
    pipe = _pipe(name)
    pipe.load_lora_weights(a, adapter_name="a")
    pipe.load_lora_weights(b, adapter_name="b")
    _warm(pipe)
    outs = {}
    for adapters in (["a"], ["b"], ["a", "b"]):
        pipe.set_adapters(adapters)
        outs[tuple(adapters)] = _call(pipe)
        assert torch.equal(outs[tuple(adapters)], _eager(pipe))
    captures = pipe.accel.stats()["transformer"].captures
    for adapters in (["a"], ["b"], ["a", "b"]):
        pipe.set_adapters(adapters)
        assert torch.equal(_call(pipe), outs[tuple(adapters)])
    assert pipe.accel.stats()["transformer"].captures == captures
    pipe.accel.restore()
