"""The VAE decoder's graphs kept only where they pay (accel/hooks/images/decoder_trial.py), on a
tiny Z-Image pipeline with emulated graphs. Emulated replays say nothing of a GPU's times, so the
trial is switched on and its clock answers as the test sets it: graphs slower than eager at
64x64, faster at 32x32."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from accel.graphs.runner import GraphRunner
from accel.hooks.images import decoder_trial
from accel.hooks.images.decoder_trial import SLOWER
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.fakes import FakePool
from tests.helpers.generate import generate

SIZES = [(64, 64), (32, 32)]
# (replay ms, eager ms) by the decoder's latent width: 64x64 images decode from 8 latent columns.
TIMES = {8: (10.0, 5.0), 6: (2.0, 3.0), 4: (1.0, 2.0)}


@pytest.fixture
def trial(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    emulate_pipelines(monkeypatch)
    monkeypatch.setattr(decoder_trial, "timed_on", lambda device: True)
    seen: dict[str, Any] = {"timed": [], "pools": []}

    def best_ms(fn: Callable[[], Any], device: torch.device, runs: int = 2) -> float:
        fn()  # it runs, as it would
        partial = fn if isinstance(fn, functools.partial) else None
        assert partial is not None
        replay = isinstance(partial.args[0], GraphRunner)
        width = partial.args[2][0].shape[-1]
        seen["timed"].append(("replay" if replay else "eager", width))
        return TIMES[width][0 if replay else 1]

    monkeypatch.setattr(decoder_trial, "best_ms", best_ms)
    before_call = decoder_trial.DecoderTrial.before_call

    def remember(self: decoder_trial.DecoderTrial) -> None:
        before_call(self)
        assert isinstance(self.runner.pool, FakePool) and self.runner.pool is not self.shared
        seen["pools"].append(weakref.ref(self.runner.pool))

    monkeypatch.setattr(decoder_trial.DecoderTrial, "before_call", remember)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield seen
    torch.set_num_threads(threads)


def _pipe() -> Any:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: Any, size: tuple[int, int]) -> torch.Tensor:
    return generate(pipe, "a lighthouse", size=size, output_type="pt", guidance=0.0)


@torch.no_grad()
def test_the_decoder_keeps_graphs_only_where_they_replay_at_least_as_fast_as_eager(trial) -> None:
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup(SIZES, cfg=False, progress=False)
    rows = {(r.width, r.height): r for r in report.rows}
    big, small = rows[SIZES[0]].decoder, rows[SIZES[1]].decoder
    assert big is not None and small is not None
    assert (big.graph_ms, big.eager_ms, big.kept) == (10.0, 5.0, False)
    assert (small.graph_ms, small.eager_ms, small.kept) == (1.0, 2.0, True)
    # Every replay timed before its eager twin, at each size.
    assert trial["timed"][:2] == [("replay", 8), ("eager", 8)] and ("replay", 4) in trial["timed"]
    text = str(report)
    assert "decode ms graph/eager" in text and "10.0 / 5.0 eager" in text and "1.0 / 2.0 graphs" in text

    decoder = pipe.accel.runners["vae.decoder"]
    shared = pipe.accel.runners["transformer"].pool
    # The kept size lives in the pipeline's shared pool, beside the denoiser's graphs; the other is refused.
    assert decoder.pool is shared and decoder.stats().entries == 1
    ((reason),) = decoder.blocked.values()
    assert reason == f"{SLOWER} at 64x64 (10.0 ms against 5.0 ms eager)"
    # The trial pools (one per timed call) are gone with their graphs.
    gc.collect()
    assert len(trial["pools"]) == len(SIZES) and all(ref() is None for ref in trial["pools"])

    said = pipe.accel.report()
    assert "capture failed" not in said
    assert "decoded eagerly: at 64x64 (10.0 ms against 5.0 ms eager)" in said
    assert "VAE decoder, timed at that warm-up: 64x64 eager (10.0 ms graphs, 5.0 eager)" in said
    assert "32x32 graphs (1.0 ms graphs, 2.0 eager)" in said

    before = decoder.stats()
    for size in SIZES:
        assert torch.equal(_image(pipe, size), _image(stock, size)), size
    after = decoder.stats()
    assert after.replays - before.replays == 1 and after.eager_calls - before.eager_calls == 1
    assert after.misses == before.misses  # refused, not missed: nothing said per call
    # Another warm-up (a new size among them) times only the new size and keeps the graphs it has.
    timed = len(trial["timed"])
    again = pipe.accel.warmup([(32, 32), (48, 48)], cfg=False, progress=False)
    assert {(r.width, r.decoder is not None) for r in again.rows} == {(48, True), (32, False)}
    assert {w for _, w in trial["timed"][timed:]} == {6}
    assert decoder.stats().entries == 2 and decoder.pool is shared and len(decoder.blocked) == 1
    assert torch.equal(_image(pipe, (32, 32)), _image(stock, (32, 32)))
    pipe.accel.restore()


@torch.no_grad()
def test_a_decoder_slower_everywhere_leaves_no_graph_and_no_pool_behind(trial, monkeypatch) -> None:
    monkeypatch.setitem(TIMES, 4, (3.0, 2.0))
    pipe = _pipe()
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup(SIZES, cfg=False, progress=False)
    decoder = pipe.accel.runners["vae.decoder"]
    assert decoder.stats().entries == 0 and len(decoder.blocked) == len(SIZES)
    assert all(r.decoder is not None and not r.decoder.kept for r in report.rows)
    # Graphs counted are the ones kept: the transformer's and the text encoder's only.
    kept = sum(pipe.accel.stats()[n].entries for n in ("transformer", "text_encoder"))
    assert report.total_captures == kept
    gc.collect()
    assert len(trial["pools"]) == len(SIZES) and all(ref() is None for ref in trial["pools"])
    # A second warm-up keeps the verdicts: nothing is tried again.
    timed = len(trial["timed"])
    pipe.accel.warmup(SIZES, cfg=False, progress=False)
    assert len(trial["timed"]) == timed and len(decoder.blocked) == len(SIZES)
    pipe.accel.restore()


def test_without_cuda_the_decoder_is_not_timed(monkeypatch) -> None:
    emulate_pipelines(monkeypatch)
    pipe = _pipe()
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup([(32, 32)], cfg=False, progress=False)
    assert report.rows[0].decoder is None and pipe.accel.runners["vae.decoder"].stats().entries == 1
    assert "decode ms" not in str(report)
    pipe.accel.restore()
