"""The graph runner's capture bookkeeping with CUDA's parts faked (:func:`fake_cuda`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from accel import GraphRunner
from accel.graphs import bcg
from accel.graphs import runner as runner_mod
from tests.helpers.fakes import FakeCuda, FakePool, fake_capture, fake_cuda_calls


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """CUDA as far as GraphRunner._capture and _replay can tell, on CPU tensors.

    Segments are dummies that replay nothing, so runners under test use ``debug=True``: the whole
    call is one eager break, which replays for real through the static inputs, the break's
    copy-back into its boundary buffer and the output copy.
    """
    state = FakeCuda()

    @contextlib.contextmanager
    def capture(graph: bcg.BreakableCUDAGraph, **_: Any) -> Iterator[bcg.BreakableCUDAGraph]:
        state.attempts += 1
        if state.fail_next_capture:
            state.fail_next_capture -= 1
            raise state.fail_with or RuntimeError("simulated capture failure")
        state.captures += 1
        with fake_capture(monkeypatch, graph=graph):
            yield graph

    fake_cuda_calls(monkeypatch)
    monkeypatch.setattr(runner_mod, "GraphPool", FakePool)
    monkeypatch.setattr(bcg, "capture", capture)
    # The inputs are CPU tensors: skip only the device checks, keep the blocked-signature one.
    monkeypatch.setattr(GraphRunner, "_capturable", lambda self, key, leaves: key not in self.store.blocked)
    return state
