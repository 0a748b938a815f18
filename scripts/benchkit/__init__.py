"""The pieces of scripts/bench.py (and the table of scripts/bench_breadth.py), one module per responsibility.

settings      constants, resolutions, how each model is run, progress lines
cli           the command line (``build_parser``, ``resolve_config``) and the compile-cache folder
environment   device and versions written beside every number
rows          typed result rows (:class:`CaseRow`, :class:`SeriesPoint`) and their JSON form
measure       clocks, GPU-busy fraction, memory watch, output differences
calls         the pipeline side: recipes, ``accelerate_pipeline``, step 0's recorded denoiser call
model_bench   one model: a case per resolution (every variant on the same call), end to end, memory series
phases        one end-to-end call split into phases: hooks and wrappers on the pipeline, CUDA events
breakdown     that split's typed result (:class:`Breakdown`) and its table in results.md
variants      eager, bcg, bcg-exact, graph
compiled      compile, compile-ro, compile-regional, bcg+compile
registry      every variant by name (name -> function), in the order a case runs them
run           the measuring loop over models, and ``save`` (results.json, results.md, plots)
report        results.md
plots         step_time.png, graph_memory.png
merge         one report from several runs (``--merge``)
breadth_table breadth.md, the table of scripts/bench_breadth.py

Nested call arguments and outputs are walked with ``accel.graphs.tree`` (``tensors``, ``clone``), the
library's one traversal. Nothing here imports diffusers at import time, so the compile-cache
folder can be set first.
"""
