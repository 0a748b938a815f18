"""One model of scripts/bench_fp8.py: bf16 and float8 rows on one pipeline, each timed end to end
with its distance to bf16 eager (latents and decoded pixels) and to itself without graphs."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from typing import Any

import torch

from .cache_bench import dbcache_config
from .calls import timed_call, warm_up
from .measure import drop_compiled
from .rows import failed
from .settings import call_kwargs, res_name
from .settings import say_clock as say

STEPS = {"z-image": 9, "qwen-image": 20, "qwen-image-2.1": 40}


def distances(out: torch.Tensor, ref: torch.Tensor, peak: float | None = None) -> dict[str, float]:
    """Largest absolute difference, relative L2 distance (and PSNR against ``peak``)."""
    d = out.double() - ref.double()
    got = {"max_abs": float(d.abs().max()), "rel_l2": float(d.norm() / ref.double().norm().clamp_min(1e-30))}
    if peak is not None:
        mse = float(d.square().mean())
        got["psnr_db"] = math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)
    return {k: float(f"{v:.4g}") if math.isfinite(v) else v for k, v in got.items()}


def pixels(images: list[Any]) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.stack([np.asarray(im, dtype=np.uint8) for im in images]))


class Bench:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args, self.model = args, model
        self.cuda = torch.cuda.is_available() and args.size == "full"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.steps = args.steps or STEPS[model]
        self.wh = args.resolution
        # Whether the calls run two guidance branches (the warm-up captures what they run).
        self.cfg = model == "qwen-image" or (model == "qwen-image-2.1" and (args.true_cfg or 1.0) > 1)
        self.ref: dict[str, torch.Tensor] = {}
        self.pipe: Any = None

    def build(self) -> None:
        from pipelines.builders import build_pipeline

        self.pipe = None
        drop_compiled(self.cuda)
        say(f"building {self.model} ({self.args.size}) on {self.device}")
        # bf16 everywhere: quantize="fp8" makes its float8 weights from bf16 ones.
        self.pipe = build_pipeline(self.model, self.args.size, device=self.device, dtype=torch.bfloat16, seed=0)
        self.pipe.set_progress_bar_config(disable=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def generate(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(seconds, final latents, decoded 8-bit pixels) of one call."""
        seconds, latents, out = timed_call(
            self.pipe,
            call_kwargs(self.model, self.wh, self.steps, self.args.true_cfg),
            self.steps,
            self.device,
            self.sync,
        )
        return seconds, latents, pixels(out.images)

    def enable_dbcache(self) -> None:
        import cache_dit

        cache_dit.enable_cache(self.pipe, cache_config=dbcache_config(self.model, 100.0))

    def accelerate(self, quantize: bool, compile: bool = True, attention: bool = False) -> dict[str, Any]:
        from accel import accelerate_pipeline

        t0 = time.perf_counter()
        options: dict[str, Any] = dict(compile=compile)
        if attention:
            options["attention"] = "fa3"
        if compile and getattr(self.args, "cold", False):
            # A fresh, empty inductor cache: this row's compiles are cold, whatever ran before.
            # Removed when the process ends (its compiled kernels may be read until then).
            import atexit
            import shutil
            import tempfile

            options["compile_cache_dir"] = tempfile.mkdtemp(prefix="bcg-fp8-cold-")
            atexit.register(shutil.rmtree, options["compile_cache_dir"], ignore_errors=True)
        if quantize:
            options.update(quantize="fp8", fp8_budget=self.args.fp8_budget)
        accelerate_pipeline(self.pipe, **options)
        report = warm_up(self.pipe, [self.wh], self.cfg, steps=2)
        row: dict[str, Any] = dict(
            setup_s=round(time.perf_counter() - t0, 2),
            capture_s=round(report.total_seconds, 2),
            compile_s=round(report.total_compile_seconds, 2),
            # What dynamo compiled in the warm-up, whether it compiled again while capturing (every
            # case captured twice) and whether a compile after the captures dropped graphs.
            compiled_graphs=report.compiled_graphs,
            capture_passes=report.capture_passes,
            recompile_drops=self.pipe.accel.hooks[next(iter(self.pipe.accel.runners))].recompile_drops,
        )
        q = self.pipe.accel.quantization
        if q is not None:
            row["quantize"] = q.summary()
            s = q.selection
            if s is not None:
                row["selection"] = dict(
                    quantized=len(s.quantized),
                    kept_by_recipe=len(s.kept_by_recipe),
                    kept_measured=list(s.kept_measured),
                    not_taken=len(s.not_taken),
                    calibration_error=s.error,
                    calibration_max_abs=s.max_abs,
                    all_quantized_error=s.all_quantized_error,
                    calibration_calls=s.runs,
                    weights_gib=[round(s.bytes_before / 2**30, 3), round(s.bytes_after / 2**30, 3)],
                    worst=sorted(s.errors.items(), key=lambda kv: -kv[1])[:8],
                    attention_fp8=len(s.attention),
                    attention_kept=list(s.attention_kept),
                )
        choice = self.pipe.accel.plan.attention
        if choice is not None:
            row["attention"] = choice.describe().strip()
        return row

    def without_graphs(self) -> tuple[float, torch.Tensor]:
        runner = self.pipe.accel.runners["transformer"]
        runner.enabled = False
        try:
            seconds, latents, _ = self.generate()
        finally:
            runner.enabled = True
        return seconds, latents

    def run(self, variant: str, backend: str) -> dict[str, Any]:
        name = variant if not variant.startswith("fp8") or backend == "default" else f"{variant}[{backend}]"
        row: dict[str, Any] = {"model": self.model, "variant": name, "resolution": res_name(self.wh)}
        cached = "dbcache" in variant
        try:
            if cached:
                self.enable_dbcache()
            if variant != "bf16-eager":
                row.update(
                    self.accelerate(
                        quantize=variant.startswith("fp8"), compile="compiled" in variant, attention="-fa3-" in variant
                    )
                )
            first, _, _ = self.generate()  # untimed: compiles and captures what the warm-up left
            row["first_call_s"] = round(first, 2)
            seconds = []
            for _ in range(self.args.runs):
                s, latents, image = self.generate()
                seconds.append(s)
            row["seconds"] = round(statistics.median(seconds), 3)
            if variant == "bf16-eager":
                self.ref = {"latents": latents, "image": image}
            if self.ref:
                row["latents"] = distances(latents, self.ref["latents"])
                row["image"] = distances(image, self.ref["image"], peak=255.0)
            if variant != "bf16-eager":
                plain_s, plain = self.without_graphs()
                row["no_graphs_s"] = round(plain_s, 3)
                row["vs_no_graphs"] = 0.0 if torch.equal(latents, plain) else distances(latents, plain)["max_abs"]
                row["report"] = self.pipe.accel.report()
            row["status"] = "ok"
        except Exception as exc:
            failed(row, exc)
        finally:
            if "accel" in vars(self.pipe):
                self.pipe.accel.restore()  # float8 layers stay float8: quantize= is one-way
            if cached:
                import cache_dit

                with contextlib.suppress(Exception):
                    cache_dit.disable_cache(self.pipe)
            # The row's compiled code holds the weights it ran on (bf16 ones the next row
            # quantizes away): let go before the next row's warm-up, which would run out of
            # memory capturing beside them.
            drop_compiled(self.cuda)
        say(json.dumps({k: v for k, v in row.items() if k != "report"}))
        return row
