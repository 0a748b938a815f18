"""Z-Image under parallel='ulysses' with its repeated blocks compiled (fullgraph), on 2 CPU processes.

Our Z-Image context-parallel plan puts diffusers' split hooks on the main layers, which are the
repeated blocks ``compile=True`` compiles, so dynamo traces the hooks. Left alone, a split hook's
first call looks its arguments up with ``inspect.signature`` inside the compiled block, and
``fullgraph=True`` fails on every rank ("Unexpected type in sourceless builder" on torch 2.11).
The recipe resolves them before each call (``pipelines.families.z_image.recipe.resolve_split_hooks``).

On the CPU ``accelerate_pipeline`` does not compile, so the worker compiles the blocks itself the
way ``accel.hooks.compiled.compile`` does on CUDA (diffusers' ``compile_repeated_blocks(fullgraph=True,
dynamic=True)``), with the ``aot_eager`` backend (dynamo's tracing is what failed; no C++
compiler needed), before the first call: the compiled call must equal the uncompiled one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers.ranks import launch_ranks

ROOT = Path(__file__).resolve().parents[2]
SIZE = 64
STEPS = 2


def _run(world: int, out: Path, timeout: float = 240.0) -> list[dict[str, Any]]:
    procs = launch_ranks(__file__, world, out, str(out))
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = {r: (out / f"rank{r}.log").read_text() for r in range(world)}
    assert codes == [0] * world, "\n".join(f"rank {r} exited {c}:\n{logs[r][-6000:]}" for r, c in enumerate(codes))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def test_zimage_ulysses_with_compiled_fullgraph_blocks_equals_uncompiled(tmp_path: Path) -> None:
    results = _run(2, tmp_path)
    for r in results:
        assert r["graphs"] > 0, "nothing was compiled"
        # Compiled and uncompiled: the same computation, the same latents, on every rank.
        assert torch.equal(r["compiled"], r["eager"]), (r["compiled"] - r["eager"]).abs().max().item()
        assert torch.equal(r["compiled"], results[0]["compiled"])
        assert not torch.equal(r["compiled"], torch.zeros_like(r["compiled"]))


# --------------------------------------------------------------------------------------------
# The worker: one rank
# --------------------------------------------------------------------------------------------
def _worker(out: Path) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"rank {os.environ['RANK']}: %(name)s: %(message)s")
    torch.set_num_threads(1)
    # diffusers' enable_parallelism picks a device as rank % accelerator count, which is 0 on a
    # CPU-only machine; the CPU stands in for one device per rank here.
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    from torch._dynamo.utils import counters

    from accel import accelerate_pipeline
    from pipelines.builders import build_pipeline

    pipe = build_pipeline("z-image", "tiny", device="cpu", dtype=torch.float32, seed=0)
    pipe.set_progress_bar_config(disable=True)
    # Guidance batches both branches, with captions of different lengths, into one call.
    kw = dict(prompt="a red fox", negative_prompt="blurry", guidance_scale=4.0, height=SIZE, width=SIZE,
              num_inference_steps=STEPS, output_type="latent")  # fmt: skip
    accelerate_pipeline(pipe, mode="eager", parallel="ulysses")
    transformer = pipe.transformer
    blocks = [m for m in transformer.modules() if type(m).__name__ in transformer._repeated_blocks]
    # Compiled before any call: the split hooks' first call is the one dynamo traces.
    transformer.compile_repeated_blocks(fullgraph=True, dynamic=True, backend="aot_eager")
    res: dict[str, Any] = {}
    res["compiled"] = pipe(**kw, generator=torch.Generator().manual_seed(7)).images.clone()
    res["graphs"] = int(counters["stats"]["unique_graphs"])
    for m in blocks:
        m._compiled_call_impl = None
    res["eager"] = pipe(**kw, generator=torch.Generator().manual_seed(7)).images.clone()
    pipe.accel.shutdown()
    torch.save(res, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
