"""The variants with torch.compile: compile, compile-ro, compile-regional, bcg+compile.

Each starts from a reset dynamo and leaves the transformer uncompiled, so the variants after it
(and eager at the next resolution) run the stock forward. Inductor's on-disk caches live in the
run's ``--compile-cache`` folder (a fresh temporary one unless told otherwise: cold numbers).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from accel import tree

from .calls import compiled_blocks, uncompile
from .measure import MemWatch, max_abs_diff
from .model_bench import Case, ModelBench
from .rows import CaseRow, rnd
from .variants import accelerated

SMOKE_CPU = (
    "smoke mode on CPU: inductor needs a C++ toolchain and tens of seconds per shape; run without --smoke to try it"
)


def _reset_dynamo() -> None:
    from torch import _dynamo

    _dynamo.reset()
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()


def _graph_count() -> int:
    """Graphs dynamo compiled in this process so far (recompiles included; a reset keeps the count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _first_call_then_steps(bench: ModelBench, row: CaseRow, case: Case, fn: Any) -> Any:
    """compile_s = the first call (compiling), then the step times; returns a later call's output."""
    clock = bench.clock
    with MemWatch(clock) as mem:
        clock.sync()
        t0 = time.perf_counter()
        fn()
        clock.sync()
        row.compile_s = rnd(time.perf_counter() - t0, 2)
        t = clock.time_steps(fn, bench.args.repeats, bench.args.warmup_calls)
        row.set(**mem.numbers())
    bench.ok(row, t)
    out = fn()
    bench.diff(row, case, out)
    row.seq_ms = rnd(clock.back_to_back(fn, bench.args.seq_calls, busy=False)[0])
    return out


def _whole(bench: ModelBench, row: CaseRow, case: Case, mode: str | None) -> None:
    """``torch.compile(transformer, mode=mode, dynamic=False)``; the first call is the compile time."""
    ro = mode == "reduce-overhead"
    if ro and not bench.clock.cuda:
        row.fail("skipped", "needs CUDA (reduce-overhead uses CUDA graphs)")
        return
    if not bench.clock.cuda and bench.args.smoke:
        row.fail("skipped", SMOKE_CPU)
        return
    _reset_dynamo()
    a, k = case.args, case.kwargs
    compiled: Any = torch.compile(bench.pipe.transformer, mode=mode, dynamic=False)

    def fn() -> Any:
        if ro:
            torch.compiler.cudagraph_mark_step_begin()
            return tree.clone(compiled(*a, **k))  # its outputs live in the graph's pool
        return compiled(*a, **k)

    try:
        _first_call_then_steps(bench, row, case, fn)
    finally:
        compiled = None  # drop the compiled module (and its graphs) before resetting dynamo
        _reset_dynamo()


def compile_whole(bench: ModelBench, row: CaseRow, case: Case) -> None:
    _whole(bench, row, case, None)


def compile_ro(bench: ModelBench, row: CaseRow, case: Case) -> None:
    _whole(bench, row, case, "reduce-overhead")


def compile_regional(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """diffusers' regional compile: ``transformer.compile_repeated_blocks(fullgraph=True, dynamic=True)``,
    no graphs. Its output is bcg+compile's second reference."""
    if not bench.clock.cuda and bench.args.smoke:
        row.fail("skipped", SMOKE_CPU)
        return
    transformer = bench.pipe.transformer
    if not getattr(transformer, "_repeated_blocks", None):
        row.fail("skipped", f"{type(transformer).__name__} declares no repeated blocks to compile")
        return
    _reset_dynamo()
    graphs0 = _graph_count()
    try:
        transformer.compile_repeated_blocks(fullgraph=True, dynamic=True)
        out = _first_call_then_steps(bench, row, case, bench.stock(case))
        row.compiled_graphs = _graph_count() - graphs0
        case.regional_out = tree.clone(tree.tensors(out))
    finally:
        uncompile(transformer)
        _reset_dynamo()


def bcg_compile(bench: ModelBench, row: CaseRow, case: Case, **options: Any) -> None:
    """``accelerate_pipeline(pipe, compile=True)``: the repeated blocks compiled by inductor (dynamic
    shapes), the breakable graphs captured over the compiled kernels."""
    if not bench.clock.cuda:
        row.fail("skipped", "needs CUDA (accelerate_pipeline compiles only on a CUDA device)")
        return
    pipe = bench.pipe
    _reset_dynamo()
    graphs0 = _graph_count()
    try:
        out = accelerated(bench, row, case, e2e=case.e2e, compile=True, **options)
        row.compiled_graphs = _graph_count() - graphs0
        if case.regional_out is not None:
            row.out_max_abs_diff_vs_regional = rnd(max_abs_diff(out, case.regional_out), 6)
    finally:
        if "accel" in pipe.__dict__:
            pipe.accel.restore()
        left = compiled_blocks(pipe.transformer)
        if left:
            reset = uncompile(pipe.transformer)
            row.notes.append(
                f"restore() left {len(left)} compiled module(s) ({', '.join(left[:3])}...); the bench reset {reset}"
            )
        _reset_dynamo()


def bcg_compile_tuned(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """``bcg+compile`` with ``--inductor``'s settings: ``accelerate_pipeline(pipe, compile=True,
    inductor=...)``, measured beside the library's default settings in the same process."""
    if not bench.args.inductor:
        row.fail("skipped", "no --inductor settings given")
        return
    row.notes.append("inductor " + ", ".join(f"{k}={v}" for k, v in bench.args.inductor))
    bcg_compile(bench, row, case, inductor=dict(bench.args.inductor))


def bcg_compile_stock(bench: ModelBench, row: CaseRow, case: Case) -> None:
    """``bcg+compile`` without the library's compiled forms (``compiled_forms=False``): diffusers'
    code compiled as it is, beside the default in the same process."""
    bcg_compile(bench, row, case, compiled_forms=False)
