"""The VAE decoder's graphs kept only where they pay (accel/hooks/images/decoder_trial.py, the rule in
decoder_verdict.py), on a tiny Z-Image pipeline with emulated graphs. Emulated replays say nothing
of a GPU's times or memory, so the trial is switched on and its measurements answer as the test
sets them: graphs slower than eager at 64x64, faster at 32x32, and in the memory cases ties that
lower the peak."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import pytest
import torch

from accel import accelerate_pipeline
from accel.graphs.runner import GraphRunner
from accel.hooks.images import decoder_trial
from accel.hooks.images.decoder_trial import NOT_KEPT, Measured
from pipelines.builders import build_pipeline
from tests.helpers.emulator import emulate_pipelines
from tests.helpers.fakes import FakePool
from tests.helpers.generate import generate

SIZES = [(64, 64), (32, 32)]
# (replay ms, eager ms) by the decoder's latent width: 64x64 images decode from 8 latent columns.
TIMES = {8: (10.0, 5.0), 6: (2.0, 3.0), 4: (1.0, 2.0)}
MiB = 2**20
# (graph pool, replay's copies out, eager transient) bytes by latent width; none unless a test sets them.
MEMORY: dict[int, tuple[int, int, int]] = {}


def _width(statics: Sequence[torch.Tensor]) -> int:
    return statics[0].shape[-1]


@pytest.fixture
def trial(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    emulate_pipelines(monkeypatch)
    monkeypatch.setattr(decoder_trial, "timed_on", lambda device: True)
    seen: dict[str, Any] = {"timed": [], "pools": []}

    def measure(fn: Callable[[], Any], device: torch.device, pool: Any, runs: int = 3) -> Measured:
        fn()  # it runs, as it would
        partial = fn if isinstance(fn, functools.partial) else None
        assert partial is not None
        replay = isinstance(partial.args[0], GraphRunner)
        width = _width(partial.args[2])
        seen["timed"].append(("replay" if replay else "eager", width))
        _, copies, transient = MEMORY.get(width, (0, 0, 0))
        return Measured(TIMES[width][0 if replay else 1], 0.0, copies if replay else transient)

    def graph_bytes(runner: GraphRunner, keys: Sequence[Hashable]) -> int:
        return MEMORY.get(_width(runner.store.entries[keys[0]].static_inputs), (0, 0, 0))[0]

    monkeypatch.setattr(decoder_trial, "measure", measure)
    monkeypatch.setattr(decoder_trial, "graph_bytes", graph_bytes)
    before_call = decoder_trial.DecoderTrial.before_call

    def remember(self: decoder_trial.DecoderTrial) -> None:
        before_call(self)
        assert isinstance(self.runner.pool, FakePool) and self.runner.pool is not self.shared
        seen["pools"].append(weakref.ref(self.runner.pool))

    monkeypatch.setattr(decoder_trial.DecoderTrial, "before_call", remember)
    monkeypatch.setattr(FakePool, "resident", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield seen
    torch.set_num_threads(threads)
    MEMORY.clear()


def _pipe() -> Any:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: Any, size: tuple[int, int]) -> torch.Tensor:
    return generate(pipe, "a lighthouse", size=size, output_type="pt", guidance=0.0)


@torch.no_grad()
def test_the_decoder_keeps_graphs_where_they_replay_faster_and_decodes_eagerly_where_slower(trial) -> None:
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
    assert "decode ms graph/eager" in text and "10.0 / 5.0 eager: slower" in text and "1.0 / 2.0 graphs" in text

    decoder = pipe.accel.runners["vae.decoder"]
    shared = pipe.accel.runners["transformer"].pool
    # The kept size lives in the pipeline's shared pool, beside the denoiser's graphs; the other is refused.
    assert decoder.pool is shared and decoder.stats().entries == 1
    ((reason),) = decoder.blocked.values()
    assert reason.startswith(
        f"{NOT_KEPT} at 64x64, the replay was slower than the eager decode (10.0 ms against 5.0 ms eager, "
        "noise 0.1 ms; graphs "
    )
    # The trial pools (one per timed call) are gone with their graphs.
    gc.collect()
    assert len(trial["pools"]) == len(SIZES) and all(ref() is None for ref in trial["pools"])

    said = pipe.accel.report()
    assert "capture failed" not in said
    assert "decoded eagerly: at 64x64, the replay was slower than the eager decode (10.0 ms against" in said
    assert "VAE decoder, timed at that warm-up: 64x64 eager (10.0 ms graphs, 5.0 eager; 0 MiB" in said
    assert "32x32 graphs (1.0 ms graphs, 2.0 eager;" in said

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


@torch.no_grad()
@pytest.mark.parametrize("middle", ["tie", "slower"])
def test_ties_keep_their_graphs_where_they_lower_the_peak_and_never_beside_a_slower_size(
    trial, monkeypatch, middle: str
) -> None:
    """Three sizes, the two large ones ties (Z-Image compiled on the H100: 73.2 / 73.4 and 55.0 /
    55.0 ms), the small one faster; the decoder's graphs about its eager transient, beside a
    smaller pool of the denoiser's graphs. Kept everywhere, the graphs replace the largest transient
    the pipeline has; with the middle size slower it decodes eagerly, and the large tie's graphs go
    too: beside that eager decode they would hold both."""
    sizes = [(64, 64), (48, 48), (32, 32)]
    monkeypatch.setitem(TIMES, 8, (73.2, 73.4))
    monkeypatch.setitem(TIMES, 6, (55.0, 55.0) if middle == "tie" else (60.0, 55.0))
    monkeypatch.setitem(TIMES, 4, (13.7, 14.1))
    MEMORY.update({8: (6200 * MiB, 0, 6400 * MiB), 6: (3500 * MiB, 0, 3600 * MiB), 4: (870 * MiB, 0, 900 * MiB)})
    monkeypatch.setattr(FakePool, "resident", 3000 * MiB)  # the shared pool: the denoiser's graphs
    pipe, stock = _pipe(), _pipe()
    accelerate_pipeline(pipe)
    report = pipe.accel.warmup(sizes, cfg=False, progress=False)
    verdicts = [r.decoder.verdict for r in report.rows if r.decoder is not None]
    decoder = pipe.accel.runners["vae.decoder"]
    if middle == "tie":
        assert verdicts == ["graphs: peak", "graphs: peak", "graphs"]
        assert decoder.stats().entries == 3 and not decoder.blocked
        assert "73.2 / 73.4 graphs: peak" in str(report) and "lowering it ('peak')" in str(report)
    else:
        assert verdicts == ["eager: tie", "eager: slower", "graphs"]
        assert decoder.stats().entries == 1 and len(decoder.blocked) == 2
        said = pipe.accel.report()
        assert "decoded eagerly: at 64x64, the replay was no faster than the eager decode beyond its noise" in said
        assert "graphs 6200 MiB, eager decode 6400 MiB" in said
        assert "decoded eagerly: at 48x48, the replay was slower than the eager decode (60.0 ms" in said
    before = decoder.stats()
    for size in sizes:
        assert torch.equal(_image(pipe, size), _image(stock, size)), size
    after = decoder.stats()
    kept = 3 if middle == "tie" else 1
    assert after.replays - before.replays == kept and after.eager_calls - before.eager_calls == 3 - kept
    pipe.accel.restore()


def test_measure_times_the_runs_and_leaves_the_pools_account_of_eager_peaks_as_it_was() -> None:
    """On the CPU the host clock; what the runs allocate is read through the pool's counters (on a
    GPU, torch's peak memory), and the pool's own eager peak (the warm-up's, per resolution) is
    the one it had before."""
    import contextlib

    class Pool:
        eager_peak = 7

        @contextlib.contextmanager
        def measure_eager(self) -> Iterator[None]:
            yield
            self.eager_peak = max(self.eager_peak, 123)

        def take_eager_peak(self) -> int:
            peak, self.eager_peak = self.eager_peak, 0
            return peak

    calls = []
    pool = Pool()
    got = decoder_trial.measure(lambda: calls.append(1), torch.device("cpu"), pool, runs=3)
    assert len(calls) == 4 and got.peak_bytes == 123 and pool.eager_peak == 7
    assert got.spread_ms >= 0 and 0 <= got.best_ms < 1e3
