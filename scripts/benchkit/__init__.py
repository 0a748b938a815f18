"""The code of the benchmarks in scripts/, one module per job; each scripts/bench_*.py is its entry point.

scripts/bench.py:
settings      constants, resolutions, how each model is run, progress lines
cli           the command line (``build_parser``, ``resolve_config``) and the compile-cache folder
environment   device and versions written beside every number
rows          typed result rows (:class:`CaseRow`, :class:`SeriesPoint`) and their JSON form
measure       clocks, GPU-busy fraction, memory watch, output differences
calls         the pipeline side: recipes, ``accelerate_pipeline``, step 0's recorded denoiser call
model_bench   one model: a case per resolution (every variant on the same call), end to end, memory series
phases        one end-to-end call split into phases: hooks and wrappers on the pipeline, CUDA events
breakdown     that split's typed result (:class:`Breakdown`)
breakdown_table  its table in results.md
variants      eager, bcg, bcg-exact, graph
compiled      compile, compile-ro, compile-regional, bcg+compile
registry      every variant by name (name -> function), in the order a case runs them
run           the measuring loop over models, and ``save`` (results.json, results.md, plots)
report        results.md
plots         step_time.png, graph_memory.png
merge         one report from several runs (``--merge``)

scripts/bench_breadth.py:
breadth_cli       its flags and the defaults that depend on the device
breadth_parent    one child process per family within its timeout; breadth.json and breadth.md
breadth_family    the child: one family built and measured, its result file after every variant
breadth_calls     timed calls at a family's geometry, per step count; per step and fixed time
breadth_variants  graphs and compiled graphs: warm-up, counters, equality with eager, why no graph
breadth_table     breadth.md

scripts/bench_lora_switch.py:
lora_run      its flags and the loop over models; lora.json and lora.md
lora_files    three random LoRAs saved as a trainer saves them
lora_bench    one model: the pipeline, its reference, the variants as timed samples
lora_report   the bars and equalities, and lora.md

scripts/bench_parallel.py:
parallel_run      its flags and the run on every rank
parallel_calls    the variants (one GPU, cfg, ulysses; eager, graphs, compiled), one variant timed and profiled
parallel_profile  a profiled call's time by kernel kind, and the GPU's idle stretches
parallel_report   device and versions, the tables, results.json and results.md

scripts/bench_caches.py: cache_run (flags, the run, results.md), cache_bench (step caches with and
without graphs on one pipeline). scripts/bench_fp8.py: fp8_run, fp8_bench (bf16 and float8 rows).
scripts/bench_guard.py: guard_timing. scripts/bench_vae.py: vae_decode. scripts/bench_memory.py:
memory_run (flags, each model's eager and graph peaks in one process, results.md).

scripts/profile_step.py:
kernels         what a kernel does, from its name (float8 GEMMs and quantization apart)
timeline        a profiled step's time by kernel and kind, busy and idle
profiler        one profiler session and the kernels and step windows read out of it
gemm_shapes     the step's Linear products by shape, float8 or bf16, each timed alone
floor           the floor those products imply at the peak rates, beside the profile
attention_shapes  the step's attention calls by shape, float8 or bf16, each timed alone (SDPA, FA3, FA3 float8)
work_floor      the floor from the work: products at the peaks or their bytes, attention at FA3's rate, nothing else
step_floors     both floors of a profiled variant and the bf16 step beside it
profile_report  profile.md

scripts/bench_ray_start.py: ray_start (a bcg-serve --ray replica's cold start, empty and warm compile
cache). scripts/bench_restart.py: restart_child (one process's compile=True warm-up with a given cache folder).
scripts/bench_serve.py: serve_runs (the timed runs on one warm engine: the pipeline's call, buckets,
the loop, a real server), serve_report (serve.md and the ratios the bars are stated in).

Nested call arguments and outputs are walked with ``accel.graphs.tree`` (``tensors``, ``clone``), the
library's one traversal. Most modules import torch, accel and diffusers at import time (benchkit.cli
too, through the registry of variants); ``cli.setup_compile_cache`` sets the compile-cache folders
before anything compiles. Importing the package puts the project on ``sys.path`` (a script runs
from a plain checkout) and the hub offline, so a script's first import of the project is benchkit's.
"""

import os
import sys
from pathlib import Path

# The benchmarks run from a plain checkout (without `pip install -e .`), so the project goes on the
# path here, before any of them imports it; and offline: every model is built with random weights.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
