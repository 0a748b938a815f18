#!/usr/bin/env python
"""The state guard's per-call cost: host time of the check that runs once per pipeline call, on the
full-size Qwen-Image and Z-Image transformers built on the meta device (every module, no weights).

Each transformer gets the library's graph hook, as ``accelerate_pipeline`` gives it. Then, per
model, medians over ``--calls`` rounds (the parts interleaved within a round, so a busy machine
slows them alike) of:

* ``weights``: every parameter's and buffer's address and version, as at the last look;
* ``state``: every watched dictionary (modules, attention processors, hook registries, configs;
  parameter dictionaries too) and the process-wide switches, as at the last look;
* ``together``: both, as the follower runs them (the collector off meanwhile);
* ``cold``: the same after writing a buffer larger than the CPU's caches, as a pipeline call
  between two checks leaves them (the check reads every watched dictionary and tensor: memory
  latency, not Python, is most of its time then);
* ``follow``: the whole per-call check of the hook (``GraphHook.follow_weights``) when nothing
  changed, what a pipeline call pays;
* ``before``: the check this one replaced (``weights_fingerprint``, ``offload_reason`` and the
  step caches' walk over the module tree), for comparison;
* ``look``: one walk after a change (what a change costs, once).

    python scripts/bench_guard.py --out out/guard
"""

from __future__ import annotations

from benchkit.guard_timing import parse_args, run


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    raise SystemExit(main())
