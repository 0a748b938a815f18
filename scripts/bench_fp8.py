#!/usr/bin/env python
"""quantize="fp8" beside bf16, end to end, each with its distance to bf16 eager, in one process.

    python scripts/bench_fp8.py --out out/fp8                                # both models, full size
    python scripts/bench_fp8.py --only z-image --out out/fp8-z
    python scripts/bench_fp8.py --only qwen-image --fp8-backend torchao scaled-mm --out out/fp8-q
    python scripts/bench_fp8.py --size tiny --steps 3 --resolution 64 --out /tmp/f   # CPU smoke
    python scripts/bench_fp8.py --only qwen-image-2.1 --variants bf16-eager bf16-graphs bf16-compiled-graphs \
        fp8-compiled-graphs --out out/q21                     # 40 steps, no guidance, K/V cache on
    python scripts/bench_fp8.py --only qwen-image-2.1 --steps 20 --true-cfg 4 \
        --variants bf16-eager bf16-graphs --out out/q21-cfg
    python scripts/bench_fp8.py --only qwen-image-2.1 --variants bf16-eager fp8-fa3-compiled-graphs \
        --form-flip fused_head_norms --runs 2 --out out/q21-heads   # a compiled form's gain, one process

Per model (Z-Image 1024x1024, 9 steps, no guidance; Qwen-Image 1024x1024, 20 steps, true CFG 4.0;
Qwen-Image 2.1 1024x1024, 40 steps, no guidance and its prefix K/V cache, as Qwen recommends, or
``--true-cfg`` with the negative prompt; full size, random weights, bf16 on CUDA), in this order
(quantizing is one-way, so the bf16 rows come first, and every further backend builds the model
again):

* ``bf16-eager``: the stock pipeline, no accelerator: the reference of every row.
* ``bf16-graphs``: ``accelerate_pipeline(pipe)``, no compile (opt-in): bit for bit with
  ``bf16-eager`` where the recipe promises it (distances 0).
* ``bf16-compiled-graphs``: ``accelerate_pipeline(pipe, compile=True)``.
* ``bf16-fa3-compiled-graphs``: the same with ``attention="fa3"`` (FlashAttention-3, the
  ``fa3-fwd`` wheel; where it cannot run, the row says why and runs the default attention).
* ``fp8-compiled-graphs``: ``quantize="fp8", compile=True``; its warm-up measures and selects the
  layers (the row keeps what it chose and measured).
* ``fp8-fa3-compiled-graphs``: ``quantize="fp8", attention="fa3", compile=True`` on a freshly
  built bf16 model: the warm-up measures the attention layers too (float8 FlashAttention-3 where
  the budget allows).
* ``fp8-dbcache-compiled-graphs``: the same with cache-dit's DBCache, the settings of
  docs/benchmarks.md (Fn=1, Bn=0, warm-up 8 steps for Qwen-Image and 4 for Z-Image, at most 3
  cached in a row, Z-Image at most 3 in all, the threshold lifted so that every step they allow is
  cached).

Each row: the median of ``--runs`` timed calls after one untimed one (decoded to PIL, from an idle
GPU to the last kernel), the warm-up's seconds, and its distance to ``bf16-eager``: the final
latents' and the decoded image's (8-bit pixels) largest absolute difference, relative L2 distance
and, for the image, PSNR. Compiled rows also give ``vs_no_graphs``: the latents' largest difference
from the same compiled (quantized, cached) pipeline with its graphs switched off, 0 when bit-equal.
The float8 layers are the library's choice for each model (the recipe's ``fp8_layers``: Qwen-Image
the library's own, Z-Image torchao's); ``--fp8-backend torchao scaled-mm`` runs every model with
each kind in turn: torchao's tensor subclass, then the opaque ``scaled_mm`` op with its one-pass
quantization (accel/hooks/fp8/scaled_mm.py). Writes ``results.json`` and ``results.md`` to
``--out`` after every row. Each compiled row also says what dynamo compiled in its warm-up
(``compiled_graphs``), whether it compiled again while capturing (``capture_passes`` 2) and
whether a later compile dropped graphs (``recompile_drops``). ``--cold`` builds the model again
before every compiled row that is not the first thing run on it (dynamo reset, an empty inductor
cache folder each): the float8 + DBCache row then measures, quantizes and compiles from scratch as
the float8 row did, so their setup seconds compare within one run (with ``TORCH_LOGS=recompiles``,
the log says what recompiled and why).
"""

from __future__ import annotations

from benchkit.fp8_run import parse_args, run


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    main()
