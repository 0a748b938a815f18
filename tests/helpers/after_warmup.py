"""What a pipeline's calls after its warm-up did, runner by runner: for the bars "after warm-up,
no eager denoiser call and no miss; the text encoder captured once per signature".

``as_on_cuda(monkeypatch)`` runs accelerated pipelines on the CPU as on a GPU: emulated graphs
(tests/helpers/emulator.py) that also refuse pageable host-to-device copies (unless
``host_copies=False``), and the recipes' call normalisation (``prepare``, which runs only for
modules on CUDA) switched on. ``tiny(name)``: a tiny built-in pipeline without its progress bar.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import accel.hooks.graph_hook as graph_hook
import accel.hooks.report as report
from tests.helpers.emulator import emulate_pipelines

__all__ = ["Counts", "as_on_cuda", "counts", "tiny"]


def as_on_cuda(monkeypatch: pytest.MonkeyPatch, host_copies: bool = True) -> None:
    """Emulated graphs that refuse pageable copies, and recipes that normalise calls as on CUDA."""
    emulate_pipelines(monkeypatch, host_copies=host_copies)
    monkeypatch.setattr(graph_hook, "module_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(report, "module_device", lambda m: torch.device("cuda"))


def tiny(name: str) -> Any:
    """The tiny built-in pipeline ``name``, its progress bar off."""
    from pipelines.builders import build_pipeline

    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclasses.dataclass(frozen=True)
class Counts:
    """One runner's counters at a moment."""

    captures: int
    replays: int
    misses: int
    eager_calls: int
    path_misses: int
    capture_failures: int
    entries: int


def counts(pipe: Any) -> dict[str, Counts]:
    """Every runner's counters now, by component name."""
    return {
        name: Counts(s.captures, s.replays, s.misses, s.eager_calls, s.path_misses, s.capture_failures, s.entries)
        for name, s in pipe.accel.stats().items()
    }


def assert_replayed_only(before: dict[str, Counts], after: dict[str, Counts], report_text: str) -> None:
    """Between ``before`` and ``after``: the denoiser replayed and never ran eagerly or missed (a
    decision path included), and nothing was captured anew; the text encoder neither (it keeps
    the one graph per signature its warm-up captured)."""
    den = after["transformer"]
    was = before["transformer"]
    assert den.replays > was.replays, report_text
    assert (den.misses, den.eager_calls, den.path_misses) == (was.misses, was.eager_calls, was.path_misses), report_text
    assert den.captures == was.captures and den.capture_failures == 0, report_text
    text = after["text_encoder"]
    assert text.captures == before["text_encoder"].captures == text.entries, report_text
    assert text.misses == before["text_encoder"].misses and text.capture_failures == 0, report_text
