"""The graph hook on one module (accel.hooks.graph_hook), on emulated CUDA graphs."""

from __future__ import annotations

import torch
from torch import nn

from accel.hooks.graph_hook import apply_graph_runner, remove_graph_runner
from accel.hooks.options import AcceleratorOptions
from tests.helpers.emulator import emulate_cuda


class SyncsInItsForward(nn.Module):
    """A model whose own forward reads a value on the host: no graph can hold that forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = int((x > 0).sum())  # a host sync in the forward's own body
        return self.proj(x) * positive


class _User:
    pass


def test_the_first_capture_never_marks_the_models_own_forward(monkeypatch) -> None:
    """A found break is never the top-level forward, also at a hook's very first capture: the
    runner knows the forward it stands for before it captures (it did only after, and marked the
    model class's forward as an eager break for the whole process)."""
    emulate_cuda(monkeypatch)
    model, user = SyncsInItsForward(), _User()
    hook = apply_graph_runner(model, AcceleratorOptions(capture_on_miss=True), name="transformer", user=user, pool=None)
    try:
        x = torch.randn(2, 4)
        assert torch.equal(model(x), SyncsInItsForward.forward(model, x))
        assert not getattr(SyncsInItsForward.forward, "__bcg_eager__", False)
        st = hook.runner.stats()
        assert st.replays == 0 and st.eager_calls == 1 and st.capture_failures == 1
        (site,) = hook.runner.found_breaks  # found, and refused as the forward itself
        assert site.function.endswith("SyncsInItsForward.forward")
        (reason,) = hook.runner.blocked.values()
        assert "not permitted when stream is capturing" in reason, reason
    finally:
        remove_graph_runner(model, user)
    assert not getattr(SyncsInItsForward.forward, "__bcg_eager__", False)
