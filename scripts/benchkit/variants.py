"""The variants without torch.compile: eager, bcg, bcg-exact, graph.

A variant is a function ``(bench, row, case) -> None`` that measures one (model, resolution) on
the case's recorded call and fills ``row``; :mod:`benchkit.registry` names them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from accel import tree
from accel.graphs import end_capture_routing
from accel.hooks import cfg_batch_hook_of

from .calls import accelerate, compiled_blocks, denoiser_name, warm_up
from .measure import MemWatch, free_memory
from .model_bench import Case, ModelBench
from .rows import CaseRow, err_text, rnd
from .settings import MiB, res_name, say


def eager(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """The stock forward, no accelerator attached; its output is every other variant's reference."""
    assert "accel" not in bench.pipe.__dict__, "the eager variant must see the stock pipeline"
    assert not compiled_blocks(bench.pipe.transformer), "the eager variant must see the stock transformer"
    clock = bench.clock
    fn = bench.stock(case)
    with MemWatch(clock) as mem:
        t = clock.time_steps(fn, bench.args.repeats, bench.args.warmup_calls)
        row.set(**mem.numbers())
    bench.ok(row, t)
    # Activation peak of one forward (for the memory-vs-resolutions comparison).
    if clock.cuda:
        free_memory(clock)
        torch.cuda.reset_peak_memory_stats(bench.device)
        before = torch.cuda.memory_allocated(bench.device)
        out = fn()
        clock.sync()
        row.activation_mb = rnd((torch.cuda.max_memory_allocated(bench.device) - before) / MiB, 1)
        bench.activation_mb[case.wh] = row.activation_mb
    else:
        out = fn()
    case.ref = tree.clone(tree.tensors(out))
    del out
    bench.busy(row, fn)
    if case.e2e:
        bench.e2e(row, case)


def accelerated(bench: ModelBench, row: CaseRow, case: Case, *, e2e: bool, **options: Any) -> Any:
    """``accelerate_pipeline(pipe, **options)``, its warm-up timed cold, then the call through the
    diffusers hook into the runner's replay. Returns the call's output."""
    clock, pipe = bench.clock, bench.pipe
    compiled = bool(options.get("compile"))
    with MemWatch(clock) as mem:
        accelerate(pipe, **options)
        accel = pipe.accel
        if compiled and not compiled_blocks(pipe.transformer):
            raise RuntimeError("accelerate_pipeline(compile=True) compiled no block (its warning says why)")
        clock.sync()
        t0 = time.perf_counter()
        report = warm_up(pipe, [case.wh], bench.cfg)
        clock.sync()
        warmup_s = time.perf_counter() - t0
        if compiled:  # the warm-up times its compiling calls (uncaptured, one per resolution) apart
            row.compile_s = rnd(report.total_compile_seconds, 2)
            warmup_s -= report.total_compile_seconds
            if report.skipped:
                row.notes.append(f"warm-up: {report.skipped}")
        row.capture_s = rnd(warmup_s, 3)
        row.captures = report.total_captures
        row.graph_mb = rnd(accel.graph_memory_bytes() / MiB, 1)
        name = denoiser_name(accel)
        st0 = accel.stats()[name]
        row.capture_only_s = rnd(st0.capture_seconds, 3)
        row.segments_per_graph = st0.segments_per_entry
        if bench.cfg and cfg_batch_hook_of(getattr(pipe, name)) is not None:
            # The pipeline's calls join both guidance branches at batch 2 (accel.hooks.cfg_batch); the
            # step timed here is one branch's forward at batch 1, captured apart, untimed.
            warm_up(pipe, [case.wh], cfg=False)
            st0 = accel.stats()[name]
        fn = bench.stock(case)  # pipe.transformer(...) -> diffusers hook -> runner replay
        t = clock.time_steps(fn, bench.args.repeats, bench.args.warmup_calls)
        st1 = accel.stats()[name]
        row.set(**mem.numbers())
    bench.ok(row, t)
    row.replays = st1.replays - st0.replays
    row.eager_fallbacks = st1.eager_calls - st0.eager_calls
    blocked = sorted(set(accel.runners[name].blocked.values()))
    if blocked:
        row.notes.append("capture failed: " + "; ".join(blocked))
    if not clock.cuda:
        row.notes.append("no CUDA: the runner runs the stock forward eagerly (0 graphs)")
    elif row.replays == 0:
        row.notes.append("no graph replayed: the benchmarked call ran eagerly")
    out = fn()
    bench.diff(row, case, out)
    bench.busy(row, fn)
    if e2e:
        bench.e2e(row, case)
    return out


def bcg(bench: ModelBench, row: CaseRow, case: Case) -> None:
    accelerated(bench, row, case, e2e=case.e2e)


def bcg_exact(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """bcg without text padding: one graph per exact text length (Qwen-Image: no mask)."""
    accelerated(bench, row, case, e2e=False, text_buckets=None)


def graph(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """One ``torch.cuda.CUDAGraph`` over the whole stock forward."""
    clock = bench.clock
    if not clock.cuda:
        row.fail("skipped", "needs CUDA (torch.cuda.CUDAGraph)")
        return
    from accel import GraphPool

    fn = bench.stock(case)
    with MemWatch(clock) as mem:
        pool = GraphPool(bench.device)
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            t0 = time.perf_counter()
            caller = torch.cuda.current_stream(bench.device)
            pool.stream.wait_stream(caller)
            with torch.cuda.stream(pool.stream):
                for _ in range(2):
                    fn()
            caller.wait_stream(pool.stream)
            clock.sync()
            try:
                with torch.cuda.graph(cuda_graph, pool=pool.handle, stream=pool.stream):
                    static_out = fn()
            except Exception as exc:
                end_capture_routing(pool.handle, pool.device)  # or the cache is never emptied again in this process
                row.fail("error", f"whole-forward capture failed: {err_text(exc)}")
                say(f"{bench.model} {res_name(case.wh)} graph: capture failed (expected for some calls): {row.reason}")
                return
            clock.sync()
            row.capture_s = rnd(time.perf_counter() - t0, 3)
            t = clock.time_steps(cuda_graph.replay, bench.args.repeats, bench.args.warmup_calls)
            row.graph_mb = rnd(pool.resident_bytes() / MiB, 1)
            row.set(**mem.numbers())
            bench.ok(row, t)
            cuda_graph.replay()
            bench.diff(row, case, static_out)
            row.notes.append("replay only: no input copy, output not cloned")
        finally:
            with contextlib.suppress(Exception):
                clock.sync()
            with contextlib.suppress(Exception):
                cuda_graph.reset()
            del cuda_graph, pool
