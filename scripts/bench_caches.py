#!/usr/bin/env python
"""Step caches with and without graphs, and cache-dit's own compile, side by side in one process.

    python scripts/bench_caches.py --model qwen-image --resolutions 1024 --out out/caches
    python scripts/bench_caches.py --model z-image --resolutions 512 1024 --variants eager bcg-compile \\
        dbcache dbcache+bcg-compile dbcache-compile --out out/caches
    python scripts/bench_caches.py --model z-image --size tiny --resolutions 64 --out /tmp/c   # CPU smoke

The model is built once (full size, random weights, bf16 on CUDA; tiny and float32 on a CPU) and
every variant runs the same pipeline call (prompt, seed, steps; decoded to PIL) end to end: the
median of ``--runs`` timed calls after one untimed call, from an idle GPU to the last kernel.
A variant is ``CACHE[+bcg[-compile]]``, ``CACHE-compile`` (the cache with cache-dit's own compile
recipe, only for ``dbcache``), or ``eager`` / ``bcg`` / ``bcg-compile`` without a cache, where
CACHE is:

* ``dbcache``: cache-dit's DBCache with its example settings for the model (Fn=1, Bn=0, warm-up 8
  steps for Qwen-Image and 4 for Z-Image, at most 3 cached steps in a row; for Z-Image at most 3
  cached in all, as the published comparison had) and its threshold lifted (random weights never
  trip the documented one): every step its settings allow is cached (9 of 20 per guidance branch
  for Qwen-Image, 3 of 9 for Z-Image).
* ``fbc``: diffusers' FirstBlockCache with a threshold that caches every step after the first
  (``--fbc-threshold`` to change it).
* ``taylorseer``: diffusers' TaylorSeer, ``cache_interval=3, disable_cache_before_step=2``.

``diff``: the largest difference of the final latents from the reference, relative to its largest
value (0: bit-identical). The reference of ``CACHE+bcg`` is ``CACHE`` (the same cache, eager); of
``CACHE+bcg-compile``, the same compiled, cached pipeline with its graphs switched off, run in the
same variant. ``cached``: steps cached (of all denoiser calls) in the last timed call.
``step ms``: the median denoiser call of a timed call, computed and cached calls apart (CUDA
events around each call), where graphs run.

Writes ``results.json`` and ``results.md`` to ``--out``. cache-dit's compile recipe
(``cache_dit.set_compile_configs()``) changes inductor's settings for the rest of the process, so
put ``dbcache-compile`` last.
"""

from __future__ import annotations

from benchkit.cache_run import parse_args, run


def main() -> None:
    run(parse_args(None, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    main()
