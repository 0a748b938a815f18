"""The timed calls of scripts/bench_breadth.py: one pipeline at one family's geometry, per step
count, and the fit of time over steps (per step, fixed)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from .rows import rnd
from .settings import say


def _fit(times: dict[int, float]) -> tuple[float, float]:
    """(seconds per step, fixed seconds): least squares over (steps, seconds)."""
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


class Runner:
    """Calls of one pipeline at one family's geometry, timed, their latents kept per step count."""

    def __init__(self, pipe: Any, fam: Any, args: argparse.Namespace, inputs: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.pipe, self.fam, self.args, self.inputs = pipe, fam, args, inputs
        self.device = torch.device(args.device)
        self.geometry = fam.geometry[args.size].as_kwargs()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def call(self, steps: int) -> Any:
        gen = self.torch.Generator(self.device).manual_seed(self.args.seed)
        out = self.pipe(
            **self.inputs,
            **self.geometry,
            num_inference_steps=steps,
            output_type="pt" if self.args.decode else "latent",
            return_dict=False,
            generator=gen,
        )
        return out[0]

    def timed(self, label: str) -> dict[str, Any]:
        """One untimed call, then ``--repeats`` timed calls per step count."""
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.call(self.args.steps[0])
        seconds: dict[int, list[float]] = {}
        latents: dict[int, Any] = {}
        for steps in self.args.steps:
            for _ in range(self.args.repeats):
                self.sync()
                t0 = time.perf_counter()
                out = self.call(steps)
                self.sync()
                seconds.setdefault(steps, []).append(time.perf_counter() - t0)
            latents[steps] = out.detach().clone()
        medians = {s: statistics.median(v) for s, v in seconds.items()}
        per_step, fixed = _fit(medians)
        usual = self.fam.steps
        row = {
            "status": "ok",
            "times_s": {str(s): [rnd(t, 6) for t in v] for s, v in seconds.items()},
            "per_step_ms": rnd(per_step * 1e3, 2),
            "fixed_ms": rnd(fixed * 1e3, 2),
            "e2e_s": rnd(fixed + usual * per_step, 3),
            "e2e_derived_from_steps": list(self.args.steps),
            "latents": {"shape": list(latents[steps].shape), "dtype": str(latents[steps].dtype).removeprefix("torch.")},
        }
        if self.device.type == "cuda":
            row["peak_gib"] = rnd(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        say(
            f"{self.fam.name} {label}: "
            + ", ".join(f"{s} steps {medians[s]:.3f} s" for s in medians)
            + f" -> {per_step * 1e3:.1f} ms/step, fixed {fixed * 1e3:.0f} ms, {usual} steps ~{fixed + usual * per_step:.2f} s"
        )
        self.latents = latents
        return row
