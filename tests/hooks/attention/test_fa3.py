"""FlashAttention-3's backends (accel/hooks/attention/fa3.py) on the CPU, through a stand-in for
the fa3-fwd wheel (tests/helpers/fake_fa3.py) that has the wheel's signature and computes what
its kernel computes: masks in the seqused form, float8 with per-head scales, the fallbacks."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from accel.hooks.attention import fa3
from tests.helpers import fake_fa3
from tests.helpers.fake_fa3 import use_fake_fa3


@pytest.fixture(autouse=True)
def _fake(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_fa3(monkeypatch)
    monkeypatch.setattr(fa3, "_said", set())


def _reference(q, k, v, mask=None, scale=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Attention in float64 (torch's), (batch, tokens, heads, dim) in and out."""
    t = [x.double().transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, attn_mask=mask, scale=scale).transpose(1, 2)


def _qkv(batch: int, tokens: int, heads: int, dim: int, seed: int, keys: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, tokens, heads, dim)] + [(batch, keys or tokens, heads, dim)] * 2
    return [torch.randn(s, generator=g).bfloat16() for s in shapes]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class NoHostSync(TorchDispatchMode):
    """Fails on an operation that copies a device value to the host (a capture would)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


def test_bf16_attention_is_the_exact_function() -> None:
    for batch, tokens, heads, dim, keys in [(1, 9, 2, 32, None), (2, 16, 3, 64, 24), (3, 5, 1, 128, 7)]:
        q, k, v = _qkv(batch, tokens, heads, dim, seed=tokens, keys=keys)
        out = fa3.fa3_attention(q, k, v)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        # bf16 rounding of the output only: the stand-in computes in float32.
        torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=0, atol=8e-3)
        scaled = fa3.fa3_attention(q, k, v, scale=0.3)
        torch.testing.assert_close(scaled.double(), _reference(q, k, v, scale=0.3), rtol=0, atol=8e-3)
    assert [c["seqused_k"] for c in fake_fa3.calls] == [False] * 6


def test_key_padding_masks_run_the_kernel_in_seqused_form_without_a_host_sync() -> None:
    rng = random.Random(0)
    cases = []
    for seed in range(6):
        batch, keys = rng.randint(1, 3), rng.randint(4, 20)
        mask = torch.rand(batch, keys, generator=torch.Generator().manual_seed(seed)) > 0.4
        mask[:, rng.randrange(keys)] = True  # every sample attends something
        cases.append((batch, keys, mask))
    # Qwen-Image's layout: text kept, text padded, then the image.
    qwen = torch.tensor([[True] * 5 + [False] * 3 + [True] * 8, [True] * 2 + [False] * 6 + [True] * 8])
    cases.append((2, 16, qwen))
    rng.shuffle(cases)
    for batch, keys, mask in cases:
        q, k, v = _qkv(batch, 6, 2, 32, seed=keys, keys=keys)
        for shaped in (mask, mask[:, None, None, :], mask[:, None, :]):
            fake_fa3.calls.clear()
            with NoHostSync():
                out = fa3.fa3_attention(q, k, v, attn_mask=shaped)
            assert fake_fa3.calls == [{"dtype": torch.bfloat16, "shape": tuple(q.shape), "seqused_k": True}]
            torch.testing.assert_close(out.double(), _reference(q, k, v, mask[:, None, None, :]), rtol=0, atol=8e-3)
    # One mask for the whole batch is broadcast.
    q, k, v = _qkv(3, 6, 2, 32, seed=1, keys=10)
    one = torch.tensor([[True] * 7 + [False] * 3])
    torch.testing.assert_close(
        fa3.fa3_attention(q, k, v, attn_mask=one).double(),
        _reference(q, k, v, one[:, None, None, :]),
        rtol=0,
        atol=8e-3,
    )


def test_compacted_keys_keep_their_order_and_count() -> None:
    mask = torch.tensor([[True, False, True, False, True], [False, False, True, True, False]])
    k = torch.arange(10.0).reshape(2, 5, 1, 1)
    moved, _, used = fa3.compact_keys(k, k.clone(), mask)
    assert used.tolist() == [3, 2] and used.dtype == torch.int32
    assert moved[0, :3].flatten().tolist() == [0.0, 2.0, 4.0] and moved[1, :2].flatten().tolist() == [7.0, 8.0]
    assert sorted(moved.flatten().tolist()) == list(range(10))  # a permutation per sample


@pytest.mark.parametrize(
    "case",
    ["float mask", "per-query mask", "float16", "float32", "head 264", "causal with a mask"],
)
def test_what_the_kernel_cannot_take_runs_diffusers_native_attention_said_once(case: str, caplog) -> None:
    q, k, v = _qkv(2, 6, 2, 32, seed=3)
    kwargs: dict = {}
    if case == "float mask":
        kwargs["attn_mask"] = torch.zeros(2, 1, 1, 6)
    elif case == "per-query mask":
        kwargs["attn_mask"] = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    elif case in ("float16", "float32"):
        q, k, v = (x.to(getattr(torch, case)) for x in (q, k, v))
    elif case == "head 264":
        q, k, v = _qkv(2, 6, 2, 264, seed=3)
    else:
        kwargs.update(attn_mask=torch.ones(2, 6, dtype=torch.bool), is_causal=True)
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
    with caplog.at_level(logging.WARNING, logger="accel"):
        out = fa3.fa3_attention(q, k, v, **kwargs)
        again = fa3.fa3_attention(q, k, v, **kwargs)
    assert fake_fa3.calls == []
    assert torch.equal(out, native(query=q, key=k, value=v, **kwargs)) and torch.equal(out, again)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("FlashAttention-3 does not take "), said
    assert "diffusers' native attention" in said[0]


def test_float8_attention_is_close_and_smoothing_keeps_shifted_keys_close() -> None:
    q, k, v = _qkv(2, 24, 3, 64, seed=5)
    out = fa3.fa3_fp8_attention(q, k, v)
    assert out.dtype == torch.bfloat16 and fake_fa3.calls[-1]["dtype"] == torch.float8_e4m3fn
    assert _rel(out, _reference(q, k, v)) < 0.05
    # Keys sharing a large offset per head (as DiT keys do): smoothed, the error stays; plain
    # per-head scales would spend the float8 range on the offset.
    offset = 20 * torch.randn(1, 1, 3, 64, generator=torch.Generator().manual_seed(1))
    shifted = (k.float() + offset).bfloat16()
    ref = _reference(q, shifted, v)
    smoothed = _rel(fa3.fa3_fp8_attention(q, shifted, v), ref)
    k8, k_scale = fa3.quantize_heads(shifted)
    q8, q_scale = fa3.quantize_heads(q)
    v8, v_scale = fa3.quantize_heads(v)
    plain = fa3._call(q8, k8, v8, None, None, False, (q_scale, k_scale, v_scale))
    assert smoothed < 0.05 and smoothed * 2 < _rel(plain, ref), (smoothed, _rel(plain, ref))
    # With a mask: the same seqused form.
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, 10:14] = False
    masked = fa3.fa3_fp8_attention(q, k, v, attn_mask=mask[:, None, None, :])
    assert fake_fa3.calls[-1]["seqused_k"] and _rel(masked, _reference(q, k, v, mask[:, None, None, :])) < 0.05


def test_per_head_scales_put_each_heads_largest_at_448() -> None:
    x = (
        torch.randn(2, 7, 3, 16, generator=torch.Generator().manual_seed(2))
        * torch.tensor([1.0, 100.0, 0.01])[None, None, :, None]
    )
    x[1, :, 2] = 0  # a head of zeros keeps a finite scale
    q, scale = fa3.quantize_heads(x.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3) and bool(torch.isfinite(scale).all())
    peak = q.float().abs().amax(dim=(1, 3))
    assert torch.equal(peak[peak > 0], torch.full_like(peak[peak > 0], fa3.E4M3_MAX))
    back = q.float() * scale[:, None, :, None]
    assert _rel(back, x.bfloat16().float()) < 0.04


def test_grouped_query_heads_share_their_groups_scale() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(1, 8, 2, 32, generator=g).bfloat16() for _ in range(2))
    ref = _reference(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(fa3.fa3_attention(q, k, v).double(), ref, rtol=0, atol=8e-3)
    assert _rel(fa3.fa3_fp8_attention(q, k, v), ref) < 0.05


def test_a_probe_on_the_meta_device_answers_with_shapes() -> None:
    """What diffusers' registry is asked with (whether a backend takes a mask): meta tensors."""
    q = torch.empty(1, 4, 2, 16, device="meta", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 4, device="meta", dtype=torch.bool)
    for fn in (fa3.fa3_attention, fa3.fa3_fp8_attention):
        out = fn(q, q, q, attn_mask=mask)
        assert out.device.type == "meta" and out.shape == q.shape
    assert fake_fa3.calls == []


def test_why_not_names_the_missing_wheel_the_device_and_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fa3.why_not_fa3(torch.device("cpu")) is None  # the stand-in, on the CPU as allowed here
    monkeypatch.setattr(fa3, "DEVICE_TYPES", ("cuda",))
    said = fa3.why_not_fa3(torch.device("cpu"))
    assert said == "it needs a CUDA GPU of compute capability 9.x (Hopper); the denoiser is on cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    said = fa3.why_not_fa3(torch.device("cuda", 0))
    assert said == "its kernels are Hopper's (compute capability 9.x); cuda:0 (NVIDIA A100) has 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fa3.why_not_fa3(torch.device("cuda", 0)) is None
    import sys

    monkeypatch.delitem(sys.modules, fa3.FA3_MODULE)
    assert fa3.why_not_fa3(torch.device("cuda", 0)) == f"the fa3-fwd wheel is not installed ({fa3.FA3_EXTRA})"
    with pytest.raises(ImportError, match=r"fa3-fwd wheel .*bcg-diffusers\[fa3\]"):
        fa3.load_fa3()


def test_the_stand_in_checks_the_wheels_signature() -> None:
    """The stand-in refuses what the library must not pass (it would change the kernel)."""
    q, k, v = _qkv(1, 4, 1, 16, seed=0)
    module = fa3.load_fa3()
    with pytest.raises(AssertionError):
        module._flash_attn_forward(q, k, v, softmax_scale=1.0, num_splits=0)
    with pytest.raises(TypeError):
        module._flash_attn_forward(q, k, v, softmax_scale=1.0, dropout_p=0.0)
    assert math.isfinite(float(module._flash_attn_forward(q, k, v, softmax_scale=1.0)[0].float().sum()))
