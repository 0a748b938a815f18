"""build_pipeline's full-size embedded models against the memory of their device (CPU): weights that
cannot fit are refused in one message before anything is allocated, instead of the kernel
killing the process (exit 137, no message)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipelines import builders, limits


def _meta_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a component anywhere but on the meta device (which holds no storage) fails."""
    real = builders.build_transformer

    def build_transformer(*args: Any, device: Any = "cpu", **kwargs: Any) -> torch.nn.Module:
        assert str(device) == "meta", "allocated before the check"
        return real(*args, device=device, **kwargs)

    monkeypatch.setattr(builders, "build_transformer", build_transformer)


def test_full_size_weights_beyond_free_memory_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _meta_only(monkeypatch)
    monkeypatch.setattr(limits, "available_memory", lambda device: 2**30)
    need = limits.embedded_weight_bytes("z-image", "full", torch.float32)
    with pytest.raises(limits.LimitError) as refused:
        builders.build_pipeline("z-image", size="full")
    assert str(refused.value) == (
        f"z-image at size 'full' has {limits.format_bytes(need)} of weights in float32 but cpu has 1.0 GiB free; "
        "size='tiny' builds in seconds anywhere"
    )
    assert need > 30 * 2**30  # 10B parameters in float32: what filled the host before


def test_tiny_models_do_not_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    def ask(device: Any) -> int:
        raise AssertionError("the tiny models always fit; their build must not wait for a memory count")

    monkeypatch.setattr(limits, "available_memory", ask)
    pipe = builders.build_pipeline("z-image", size="tiny")
    assert type(pipe).__name__ == "ZImagePipeline"
