#!/usr/bin/env python
"""Side-by-side benchmark: eager vs bcg-diffusers vs one whole-forward CUDA graph vs torch.compile.

For each model (Qwen-Image, Z-Image) the pipeline is built once; for each resolution every variant
runs in this one process on the *same* denoiser call: the exact ``pipe.transformer(...)`` call of
step 0 of a real pipeline run at that resolution (recorded with a forward pre-hook; Z-Image passes
positional lists, Qwen-Image keyword arguments; with Qwen-Image's true CFG a step makes two calls of
different text lengths and the first, the conditional one, is benchmarked).

Variants (``--variants``; the registry is ``scripts/benchkit/registry.py``):

* ``eager``      the stock forward, no accelerator attached.
* ``bcg``        ``accelerate_pipeline(pipe)`` + ``pipe.accel.warmup`` (timed cold: the capture
                 cost), then the call goes through the diffusers hook into the runner's replay.
                 On a CPU it still runs: the runner then runs the stock forward eagerly.
* ``bcg-exact``  the same without text padding (``text_buckets=None``): one graph per exact length.
* ``graph``      one ``torch.cuda.CUDAGraph`` over the whole stock forward (2 warm-up runs on a
                 side stream, capture, replay). A forward that cannot be captured whole records
                 status "error" with the reason. Needs CUDA.
* ``compile``    ``torch.compile(transformer, dynamic=False)``; the first call is the compile time.
* ``compile-ro`` the same with ``mode="reduce-overhead"`` (CUDA graphs inside). Needs CUDA.
* ``compile-regional``  diffusers' ``transformer.compile_repeated_blocks(fullgraph=True,
                 dynamic=True)``: regional compile, no graphs; the first call is the compile time.
* ``bcg+compile`` ``accelerate_pipeline(pipe, compile=True)``: the repeated blocks compiled by
                 inductor (dynamic shapes), the breakable graphs captured over the compiled kernels.
                 Its warm-up reports compile and capture seconds apart (compile_s, capture_s); its
                 output is compared with eager's and with compile-regional's of the same process.
  Compile variants take a minute or two per resolution on full-size models, so they are opt-in
  on GPU. On CPU in ``--smoke`` mode they are skipped (inductor on a CPU needs a C++ toolchain and
  tens of seconds per shape even for the tiny models, which would dwarf the smoke run).

Measured per (model, resolution, variant): median step time over ``--repeats`` after warm-up
(CUDA events on GPU, wall clock on CPU), median host time (wall time until the call returns: the
launch overhead), back-to-back time per call, GPU-busy fraction (eager and bcg: kernel time from
the profiler's CUDA activity, union of intervals, over the wall time of a back-to-back sequence),
capture/compile time, peak memory (``torch.cuda.max_memory_allocated``, reset per variant), graph
memory, the largest difference of the output from eager's, and end to end (eager vs bcg) at
``--e2e-resolutions``: the full pipeline call with the model's realistic setting (Z-Image: 9 steps,
guidance 0 as Turbo; Qwen-Image: true CFG with a negative prompt, ``--steps-e2e`` steps), median
of ``--e2e-runs`` runs after one warm-up run, same seed, final latents compared (bit-equal expected
for Z-Image; max abs difference for Qwen-Image, whose text is padded to a bucket under bcg).
``--breakdown`` (on wherever end to end runs; ``--no-breakdown`` skips it): one more end-to-end call per
variant, after the timed ones, split into phases that do not overlap: the text encoder's forward
calls (Qwen-Image with true CFG encodes twice), the rest of ``encode_prompt``, the denoiser's calls,
the rest of the denoising loop (scheduler steps, guidance, callbacks; the loop is bracketed by the
pipeline's ``with self.progress_bar(...)``), ``vae.decode``, ``image_processor.postprocess`` and
other, plus "outside the denoiser" = call minus the denoiser's calls. On a GPU each phase is bracketed
by CUDA events recorded on the current stream and read after one synchronize at the end of the call
(the hooks add no host sync); on a CPU by the host clock. Module forward pre/post hooks and
instance-attribute wrappers, all removed afterwards (``scripts/benchkit/phases.py``).
After the cases of a model, a "memory vs number of captured resolutions" series warms up the
``--series-count`` largest resolutions one after the other on one accelerated pipeline.

compile_s is the first call. Inductor's and triton's on-disk caches live in the ``--compile-cache``
folder (default: a fresh temporary one, so compile times are cold); the run records whether the
folder was empty at its start (cold) or not (warm). For warm numbers run twice with the same
``--compile-cache DIR`` and ``--merge`` both runs: the report shows cold and warm setup seconds side
by side. Within one run, later compiles reuse what earlier ones wrote (``--no-compile-cache``
disables that too).

Default GPU set (full-size random-weight models, bf16, both models, 256 512 768 1024 768x512,
eager bcg graph, end to end at 512 and 1024): about 6 minutes on one H200 (Z-Image ~1.5 min,
Qwen-Image ~4 min, most of it Qwen-Image's eager end-to-end runs: 20 steps x 2 calls at ~0.2 s).
Each compile variant adds its compile time per resolution and model (on the H200: 37-65 s for
Z-Image, 124-145 s for Qwen-Image).

Outputs under ``--out``: results.json, results.md, step_time.png, graph_memory.png (rewritten
after every case, so a run stopped early still leaves its numbers). Runs too long for one sitting
(compile variants on both models take over half an hour) can be split by model and resolution and
joined with ``--merge DIR ...``, which measures nothing and writes one report.

    python scripts/bench.py --out out/bench                       # GPU default set
    python scripts/bench.py --smoke --out /tmp/bench              # tiny models on CPU, seconds
    python scripts/bench.py --models z-image --resolutions 512 1024 --variants eager bcg compile-ro --out out/zc
    python scripts/bench.py --merge out/zc out/qc --out out/compile   # one report from separate runs
    python scripts/bench.py --models z-image --variants eager bcg compile-regional bcg+compile \\
        --compile-cache /tmp/cc --out out/cold                    # then again with --out out/warm
    python scripts/bench.py --merge out/cold out/warm --out out/coldwarm
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchkit.cli import build_parser, resolve_config, setup_compile_cache
from benchkit.merge import merge_results
from benchkit.rows import err_text
from benchkit.settings import parse_resolution, say

__all__ = ["build_parser", "main", "merge_results", "parse_resolution", "resolve_config"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from benchkit.run import measure, save

    if args.merge:
        try:
            parts = [json.loads((Path(d) / "results.json").read_text()) for d in args.merge]
            merged = merge_results(parts)
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"--merge: {err_text(exc)}") from None
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save(merged, out, plots=True)
        say(f"merged {len(parts)} runs, {len(merged['cases'])} cases into {out / 'results.json'}")
        return 0
    args = resolve_config(args)
    cache = setup_compile_cache(args)  # before diffusers is imported and anything compiles
    return measure(args, cache)


if __name__ == "__main__":
    sys.exit(main())
