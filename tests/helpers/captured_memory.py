"""One check run on emulated graphs (tests/graphs/test_captured_memory.py) and on CUDA's
(tests/cuda/test_captured_memory.py), so that the two are seen to agree: a replay reads the memory
a graph was captured with, not the tensor objects.

* An in-place edit through ``.data`` moves no version counter, but writes the same memory: a
  replay reads the new values (equal to eager, no capture needed).
* ``weight.data = other`` gives the parameter other memory: a replay without the guard still
  reads the old memory (stale). The guard sees the address change (tests/helpers/state_matrix.py
  has both rows on whole pipelines).

And a capture keeps only what its replays read: of the tensors the captured call makes in its
eager warm-up runs, its capture pass and its verification, only the capture pass's output buffer
stays alive (beside the static inputs the runner made); on CUDA the allocated bytes say the same.
"""

from __future__ import annotations

import gc
import weakref

import torch

from accel.graphs.runner import GraphRunner


def check_a_replay_reads_the_memory_it_was_captured_with(device: str, dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator(device).manual_seed(0)
    lin = torch.nn.Linear(32, 32, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 32, generator=g, device=device, dtype=dtype) / 6)
    x = torch.randn(8, 32, generator=g, device=device, dtype=dtype)
    runner = GraphRunner(lin, name="linear", capture_on_miss=True)
    with torch.no_grad():
        runner(x)
        assert torch.equal(runner(x), lin(x)) and runner.stats().replays >= 1
        version = lin.weight._version
        lin.weight.data.mul_(0.5)
        assert lin.weight._version == version  # nothing but the memory tells
        assert torch.equal(runner(x), lin(x)), "a replay did not read an in-place edit of its weight"
        held = lin.weight.data  # the old memory, kept alive so that reading it stays defined
        lin.weight.data = torch.randn(32, 32, generator=g, device=device, dtype=dtype)
        stale = runner(x)
        assert torch.equal(stale, torch.nn.functional.linear(x, held, lin.bias)), "a replay read the new memory"
        assert not torch.equal(stale, lin(x))
        captures = runner.stats().captures
        runner.release(recapture=True)  # what the guard does when it sees the address move
        runner(x)
        assert runner.stats().captures > captures and torch.equal(runner(x), lin(x))


def check_a_capture_keeps_only_what_its_replays_read(device: str) -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def call(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        g = torch.relu(h - 1)
        out = g + h
        made.extend(weakref.ref(t) for t in (h, g, out))
        return out

    x = torch.randn(1024, 1024, device=device)
    runner = GraphRunner(call, name="kept", capture_on_miss=True, verify=True)  # verify: one more eager run
    gc.collect()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    with torch.no_grad():
        got = runner(x)
        assert torch.equal(got, call(x))
    del got
    made[-3:] = []  # the reference call's own
    gc.collect()
    (entry,) = runner.store.entries.values()
    (chain,) = entry.tree.chains.values()
    alive = [t for r in made if (t := r()) is not None]
    assert len(made) >= 4 * 3  # two warm-up runs, the capture pass, the verification
    assert len(alive) == 1 and alive[0] is chain.output, [tuple(t.shape) for t in alive]
    if device == "cuda":
        # The static input and the output buffer; the intermediates' blocks are free in the pool.
        grown = torch.cuda.memory_allocated() - before
        assert grown <= 2 * x.nbytes + (1 << 20), grown
