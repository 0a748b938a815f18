"""Memory-aware admission: a configuration that cannot fit is refused at start in one line naming
what to lower; while serving, a batch is admitted at the largest bucket that fits what is left,
split into calls of that bucket, made to wait while none fits, and made again smaller after a
call that ran out of memory all the same. Nothing is lost: every request gets every image, each
the one its seed makes alone. Estimates and budgets are fakes here (the real estimate is
pipelines.memory_estimate's, tested with it); the worker and engine are the server's."""

from __future__ import annotations

import functools
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelines.serve.admission import Admission, AdmissionError, Part, split
from pipelines.serve.batcher import Batcher, Work
from pipelines.serve.engine import Engine
from pipelines.serve.metrics import Metrics
from pipelines.serve.worker import DeviceWorker
from tests.pipelines.serve.server import TINY, bcg_serve, decode
from tests.pipelines.serve.test_engine import FakePipeline, engine, request

MIB = 2**20
SMALL, LARGE = (256, 256), (512, 512)


def need(batch: int, size: tuple[int, int], graphs: bool) -> int:
    """1 MiB per image at 256x256, 4 at 512x512; captured graphs double it."""
    return batch * (size[0] * size[1] // 65536) * MIB * (2 if graphs else 1)


def test_a_configuration_that_cannot_fit_is_refused_naming_what_to_lower() -> None:
    admission = Admission((1, 2, 4, 8), need, budget=20 * MIB)
    with pytest.raises(AdmissionError) as refused:
        admission.check([SMALL, LARGE], graphs=False)
    line = str(refused.value)
    assert "\n" not in line and refused.value.status == 2
    assert line.startswith("batch 8 at 512x512 needs about 32.0 MiB of device memory but the budget is 20.0 MiB")
    assert "lower to --batch-sizes 1 2 4, or --resolutions 256x256 (or raise --memory-budget)" in line
    with pytest.raises(AdmissionError) as refused:
        Admission((1, 2), need, budget=3 * MIB).check([LARGE], graphs=False)
    assert str(refused.value) == ("batch 2 at 512x512 needs about 8.0 MiB of device memory but the budget is 3.0 MiB "
                                  "(one image alone needs about 4.0 MiB): lower to --resolutions below 512x512 (or "
                                  "raise --memory-budget)")  # fmt: skip
    Admission((1, 2, 4), need, budget=16 * MIB).check([SMALL, LARGE], graphs=False)  # fits: nothing said
    Admission((1, 2, 4, 8), need, budget=None).check([LARGE], graphs=True)  # no budget known: a CPU


def test_a_call_is_admitted_at_the_largest_bucket_that_fits_what_is_left() -> None:
    held = [0]
    admission = Admission((1, 2, 4, 8), need, budget=20 * MIB, held=lambda: held[0])
    assert admission.limit(SMALL) == 8 and admission.limit(LARGE) == 4
    held[0] = 10 * MIB  # graphs captured since hold memory: less is left
    assert admission.limit(LARGE) == 2
    admission.warm = {(4, LARGE)}  # captured by the warm-up: its memory is in the pool already
    assert admission.limit(LARGE) == 4
    held[0] = 19 * MIB
    assert admission.limit(SMALL) == 1 and Admission((2, 4), need, 20 * MIB, lambda: 19 * MIB).limit(SMALL) == 0
    admission.measured({(1, SMALL): 2 * MIB})  # measured above the estimate: the measurement counts
    assert admission.limit(SMALL) == 0


def test_a_bucket_that_ran_out_of_memory_is_not_used_again_at_that_size() -> None:
    admission = Admission((1, 2, 4, 8), need, budget=None)
    admission.warm = {(b, LARGE) for b in (1, 2, 4, 8)}
    admission.refuse(4, LARGE)
    assert admission.limit(LARGE) == 2 and admission.limit(SMALL) == 8
    assert (8, LARGE) not in admission.warm and (2, LARGE) in admission.warm


def test_split_keeps_each_requests_images_in_order() -> None:
    assert split([1, 2, 1], 4) == [[Part(0, 0, 1), Part(1, 0, 2), Part(2, 0, 1)]]
    assert split([3, 2], 2) == [[Part(0, 0, 2)], [Part(0, 2, 3), Part(1, 0, 1)], [Part(1, 1, 2)]]
    with pytest.raises(ValueError):
        split([1], 0)


class OutOfMemoryAbove(FakePipeline):
    """Runs out of device memory in calls of more than ``rows`` rows, as torch says it."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    @functools.wraps(FakePipeline.__call__)  # its signature: the call's arguments are read from it
    def __call__(self, prompt: list[str], *args: Any, **kwargs: Any) -> Any:
        if len(prompt) > self.rows:
            self.calls.append(dict(prompt=list(prompt), failed=True))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().__call__(prompt, *args, **kwargs)


def serve_all(e: Engine, works: list[Work], max_batch: int = 4) -> Metrics:
    """``works`` queued, then served by a device worker over ``e``; returns its metrics."""
    batcher = Batcher(max_queue=16, max_batch=max_batch, max_wait=0.0)
    metrics = Metrics(max_batch, lambda: batcher.depth, e.batch_sizes)
    fatal: list[BaseException] = []
    worker = DeviceWorker(batcher, metrics, lambda: e, lambda engine: None, fatal.append, admission_wait=30)
    worker._poll = 0.01
    for w in works:
        batcher.submit(w)
    worker.start()
    for w in works:
        w.future.result(60)
    batcher.close()
    worker.join(10)
    assert not worker.is_alive() and not fatal
    return metrics


def alone(seed: int) -> bytes:
    """The pixels the fake pipeline makes for ``seed`` in a call of its own."""
    e = engine(FakePipeline())
    (images,) = e.run([e.plan(request("x", seed=seed))])
    return decode(images[0].b64_json).tobytes()


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(name)


def test_a_call_that_runs_out_of_memory_is_made_again_smaller_and_nothing_is_lost() -> None:
    pipe = OutOfMemoryAbove(rows=2)
    e = engine(pipe)
    e.batch_sizes = (1, 2, 4)
    e.admission = Admission(e.batch_sizes, need, budget=None)
    plans = [e.plan(request("a", seed=10)), e.plan(request("b", n=2, seed=20)), e.plan(request("c", seed=30))]
    works = [Work(p.key, p.request.n, p) for p in plans]
    metrics = serve_all(e, works)
    # The worker hands on images; the routes encode them (RenderedImage.encode).
    made = [[(m.seed, decode(m.encode().b64_json).tobytes()) for m in w.future.result()] for w in works]
    assert [[s for s, _ in images] for images in made] == [[10], [20, 21], [30]]
    assert all(image == alone(seed) for images in made for seed, image in images)
    assert [len(c["prompt"]) for c in pipe.calls] == [4, 2, 2]  # bucket 4 failed, then two calls of 2
    assert pipe.calls[0].get("failed") and e.admission.limit((16, 8)) == 2
    assert sample(metrics, "bcg_serve_pipeline_calls_total", ran="out_of_memory") == 1
    assert sample(metrics, "bcg_serve_images_total") == 4
    # A later batch at that size is formed for what fits: no second failure.
    more = [Work(p.key, p.request.n, p) for p in (e.plan(request("d", n=2, seed=1)), e.plan(request("e", seed=3)))]
    serve_all(e, more)
    assert [len(c["prompt"]) for c in pipe.calls[3:]] == [2, 1]


def test_one_image_that_runs_out_of_memory_fails_its_request_in_one_line() -> None:
    e = engine(OutOfMemoryAbove(rows=0))
    e.batch_sizes = (1, 2)
    e.admission = Admission(e.batch_sizes, need, budget=None)
    work = Work(*(lambda p: (p.key, 1, p))(e.plan(request("a"))))
    batcher = Batcher(max_queue=4, max_batch=2, max_wait=0.0)
    worker = DeviceWorker(batcher, Metrics(2, lambda: 0), lambda: e, lambda engine: None, lambda error: None)
    batcher.submit(work)
    worker.start()
    message = str(work.future.exception(30))
    batcher.close()
    worker.join(10)
    assert message == "generation failed: out of device memory making 1 image(s) at 16x8 in a call of batch 1"


def test_a_batch_waits_for_memory_then_runs_split_to_what_fits() -> None:
    pipe = FakePipeline()
    e = engine(pipe)
    e.batch_sizes = (1, 2, 4)
    held = [102 * MIB]  # nothing fits until memory is given back
    e.admission = Admission(e.batch_sizes, lambda b, s, g: b * MIB, budget=102 * MIB, held=lambda: held[0])
    plans = [e.plan(request("a", n=3, seed=0)), e.plan(request("b", seed=5))]
    works = [Work(p.key, p.request.n, p) for p in plans]
    timer = threading.Timer(0.3, lambda: held.__setitem__(0, 101 * MIB))  # then room for one image at a time
    t0 = time.monotonic()
    timer.start()
    serve_all(e, works)
    assert time.monotonic() - t0 >= 0.3 and [len(c["prompt"]) for c in pipe.calls] == [1, 1, 1, 1]
    assert [[g.seed for g in w.future.result()] for w in works] == [[0, 1, 2], [5]]
    held[0] = 98 * MIB
    assert e.admission.limit((16, 8)) == 4


def test_bcg_serve_refuses_a_budget_its_largest_bucket_cannot_fit(tmp_path: Path) -> None:
    run = subprocess.run([*bcg_serve(), *TINY, "--batch-sizes", "1", "2", "4", "--memory-budget", "0.00001",
                          "--port", "0"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr
    (line,) = [x for x in run.stderr.splitlines() if "could not start" in x]
    assert "batch 4 at 64x64 needs about" in line and "one image alone needs about" in line, line
    assert line.endswith("lower to --resolutions below 64x64 (or raise --memory-budget)"), line
