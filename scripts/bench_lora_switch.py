#!/usr/bin/env python
"""LoRA changes on an accelerated pipeline: a hot-swap and a switch back to an adapter captured
before, each beside a recapture of the same pipeline, and a plain call as the floor.

    python scripts/bench_lora_switch.py --models z-image --out out/lora                # GPU: 1024x1024, 9 steps
    python scripts/bench_lora_switch.py --models qwen-image --exact-text --out out/lora  # 512x512, 20 steps, true CFG
    python scripts/bench_lora_switch.py --size tiny --resolution 64 --steps 2 --out /tmp/lora   # CPU smoke

Per model, in one process: the pipeline is built (full size, random weights, bf16 on CUDA; tiny
and float32 on a CPU), three random LoRAs of ``--rank`` for its denoiser are made (peft's
``LoraConfig`` on ``to_q``, ``to_k``, ``to_v``, saved as .safetensors files the way a trainer
saves them), ``pipe.enable_lora_hotswap(target_rank=--rank)`` is called before the first load,
LoRA A is loaded as adapter ``a``, the pipeline is accelerated with the library's defaults and
warmed up at the resolution. Then each variant, ``--repeats`` times (medians):

* ``plain``: a call with nothing changed: the floor;
* ``hot-swap``: ``load_lora_weights(B or A, adapter_name="a", hotswap=True)`` (B, A, B...), then a
  call; it must capture nothing;
* ``switch-back``: LoRA C loaded the ordinary way as adapter ``b`` (new weights: captured again),
  a call under ``a`` and one under ``b`` (each state's graphs captured); then ``set_adapters("a")``
  and a call, which must capture nothing (``a``'s graphs replayed), and ``set_adapters("b")`` and
  an untimed call (nothing captured either);
* ``recapture``: a fresh adapter loaded the ordinary way (B or C under a new name) and made the
  only active one, then a call, which captures the denoiser's graphs again; the fresh adapter is
  deleted afterwards, untimed.

Each timed sample is the wall time from the start of the change to the end of the next call (CUDA
synchronised before and after), split into the change and the call; ``cost`` is that time less the
floor (what the change cost, compared with not changing anything). ``captures`` and ``capture s``
are the counters of every runner of the pipeline (``pipe.accel.stats()``) over the change and the
call. The bars: a hot-swap and a switch back capture nothing, and a hot-swap costs under a tenth of
a recapture.

Correctness, on the first sample of each variant: the images (the call's decoded output, floats)
against ``--reference``: ``stock`` (default) is a second pipeline built alike, never accelerated,
to which every change is made too; ``no-graphs`` is the same pipeline with every runner switched
off (what the model computes now, through the same hooks; no second pipeline's memory); ``none``.
Asserted equal bit for bit where the library promises it: always against ``no-graphs``; against
``stock``, except for Qwen-Image with its text padded (its default at 768x768 and below; the
distance is printed, ``--exact-text`` turns padding off). The hot-swapped image must also differ
from the floor's (else the swap proved nothing). A failed assertion or bar on captures makes the
exit status 1 (after the files are written); the speed bar is reported, never asserted.

Writes ``lora.json`` and ``lora.md`` to ``--out`` after every model.
"""

from __future__ import annotations

from benchkit.lora_run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv, description=__doc__.split("\n\n")[0]))


if __name__ == "__main__":
    raise SystemExit(main())
