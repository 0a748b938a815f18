"""accel.hooks.compiled.fused on the CPU: the GELU(tanh) projection as one opaque op, the stock path
wherever fusing could bypass something (the cuBLASLt epilogue itself is exercised on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward

from accel.hooks.compiled import fused
from accel.hooks.compiled.fused import addmm_gelu_tanh, fuse_gelu_epilogues
from tests.helpers.traced import traced


def _ff(activation: str) -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(dim=24, dim_out=24, activation_fn=activation).eval()


def test_the_op_is_gelu_tanh_of_the_projection_and_opaque_to_dynamo() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    want = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert torch.equal(addmm_gelu_tanh(x, w, b), want)
    assert torch.equal(addmm_gelu_tanh(x, w, None), F.gelu(F.linear(x, w), approximate="tanh"))
    got, seen = traced(addmm_gelu_tanh, x, w, b, dynamic=True)
    assert torch.equal(got, want)
    assert seen == [torch.ops.bcg_diffusers.addmm_gelu_tanh.default]


@torch.no_grad()
def test_only_tanh_gelu_projections_are_fused_and_undo_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    tanh, exact = _ff("gelu-approximate"), _ff("gelu")
    model = torch.nn.ModuleList([tanh, exact])
    x = torch.randn(3, 7, 24)
    want = [tanh(x), exact(x)]
    undo = fuse_gelu_epilogues(model)
    try:
        patched = [m for m in model.modules() if "forward" in vars(m)]
        # The tanh feed-forward (for a float8 down projection) and its GELU; nothing of the exact one.
        assert patched == [tanh, tanh.net[0]] and isinstance(patched[1], GELU)
        assert torch.equal(tanh(x), want[0]) and torch.equal(exact(x), want[1])
        calls = []
        monkeypatch.setattr(fused, "addmm_gelu_tanh", lambda *a: calls.append(1) or addmm_gelu_tanh(*a))
        tanh(x)
        exact(x)
        assert len(calls) == 1, "the tanh projection should call the fused op, and only it"
    finally:
        undo()
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_replaced_projection_or_a_call_with_gradients_runs_the_stock_way() -> None:
    ff = _ff("gelu-approximate")
    x = torch.randn(2, 3, 24)
    undo = fuse_gelu_epilogues(ff)
    try:
        with torch.no_grad():
            want = F.gelu(ff.net[0].proj(x), approximate="tanh")

        class Lora(torch.nn.Module):  # what a LoRA wrapper looks like from outside: not an nn.Linear
            def __init__(self, base: torch.nn.Linear) -> None:
                super().__init__()
                self.base = base

            def forward(self, h: torch.Tensor) -> torch.Tensor:
                return self.base(h) + 1.0

        with torch.no_grad():
            base = ff.net[0].proj
            ff.net[0].proj = Lora(base)
            assert torch.equal(ff.net[0](x), F.gelu(base(x) + 1.0, approximate="tanh"))
            ff.net[0].proj = base
        out = ff.net[0](x)  # gradients on: the op has no backward, the stock path has
        assert out.requires_grad and torch.allclose(out, want)
        out.sum().backward()
        assert ff.net[0].proj.weight.grad is not None
    finally:
        undo()


@pytest.mark.parametrize("dtype", [torch.float32])
def test_the_fake_gives_the_shape(dtype: torch.dtype) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = addmm_gelu_tanh(torch.empty(2, 9, 16, dtype=dtype), torch.empty(40, 16, dtype=dtype), None)
    assert tuple(out.shape) == (2, 9, 40) and out.dtype == dtype


class _TakesGelu(torch.nn.Linear):
    """A down projection that takes the GELU into its input (what a float8 layer offers)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.pre: list[torch.Tensor] = []

    def forward_after_gelu_tanh(self, pre: torch.Tensor) -> torch.Tensor:
        self.pre.append(pre)
        return self(F.gelu(pre, approximate="tanh")) + 0.5  # marked, so the path taken shows


@torch.no_grad()
def test_a_feed_forward_hands_a_down_projection_that_takes_the_gelu_the_up_projections_output() -> None:
    ff = _ff("gelu-approximate")
    x = torch.randn(2, 3, 24)
    want = ff(x)
    ff.net[2] = down = _TakesGelu(ff.net[2])
    undo = fuse_gelu_epilogues(ff)
    try:
        got = ff(x)
        assert len(down.pre) == 1 and torch.equal(down.pre[0], F.linear(x, ff.net[0].proj.weight, ff.net[0].proj.bias))
        assert torch.allclose(got, want + 0.5, atol=1e-6)
        ff.train()  # dropout is 0: still the fused path
        ff(x)
        assert len(down.pre) == 2
        ff.net[1].p = 0.1  # an active dropout sits between them: the stock path
        torch.manual_seed(1)
        got = ff(x)
        torch.manual_seed(1)
        assert torch.equal(got, ff.net[2](ff.net[1](ff.net[0](x))))
        assert len(down.pre) == 2
        ff.eval()
        ff.net[2] = plain = torch.nn.Linear(96, 24)  # a plain layer: the stock path
        assert torch.equal(ff(x), plain(ff.net[0](x)))
    finally:
        undo()
    assert "forward" not in vars(ff)


def test_a_feed_forward_under_gradients_runs_the_stock_way() -> None:
    ff = _ff("gelu-approximate")
    ff.net[2] = down = _TakesGelu(ff.net[2])
    x = torch.randn(2, 3, 24)
    undo = fuse_gelu_epilogues(ff)
    try:
        out = ff(x)
        assert not down.pre and out.requires_grad
    finally:
        undo()


@torch.no_grad()
def test_a_down_projection_measured_through_its_forward_takes_the_stock_path() -> None:
    """quantize="fp8"'s selection measures a float8 layer by wrapping its forward: the feed-forward
    then calls that forward, so the layer's error is measured, not skipped."""
    ff = _ff("gelu-approximate")
    ff.net[2] = down = _TakesGelu(ff.net[2])
    x = torch.randn(2, 3, 24)
    measured = []
    stock = down.forward
    down.forward = lambda h: measured.append(h) or stock(h)  # as the selection's measurement wraps it
    undo = fuse_gelu_epilogues(ff)
    try:
        out = ff(x)
        assert not down.pre and len(measured) == 1 and torch.equal(out, stock(ff.net[0](x)))
    finally:
        undo()
