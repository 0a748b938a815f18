#!/usr/bin/env python
"""quantize="fp8" beside bf16, end to end, each with its distance to bf16 eager, in one process.

    python scripts/bench_fp8.py --out out/fp8                                # both models, full size
    python scripts/bench_fp8.py --only z-image --out out/fp8-z
    python scripts/bench_fp8.py --only qwen-image --fp8-backend torchao scaled-mm --out out/fp8-q
    python scripts/bench_fp8.py --size tiny --steps 3 --resolution 64 --out /tmp/f   # CPU smoke

Per model (Z-Image 1024x1024, 9 steps, no guidance; Qwen-Image 1024x1024, 20 steps, true CFG 4.0;
full size, random weights, bf16 on CUDA), in this order (quantizing is one-way, so the bf16 rows
come first, and every further backend builds the model again):

* ``bf16-eager``: the stock pipeline, no accelerator: the reference of every row.
* ``bf16-compiled-graphs``: ``accelerate_pipeline(pipe, compile=True)``.
* ``fp8-compiled-graphs``: ``quantize="fp8", compile=True``; its warm-up measures and selects the
  layers (the row keeps what it chose and measured).
* ``fp8-dbcache-compiled-graphs``: the same with cache-dit's DBCache, the settings of
  docs/benchmarks.md (Fn=1, Bn=0, warm-up 8 steps for Qwen-Image and 4 for Z-Image, at most 3
  cached in a row, Z-Image at most 3 in all, the threshold lifted so that every step they allow is
  cached).

Each row: the median of ``--runs`` timed calls after one untimed one (decoded to PIL, from an idle
GPU to the last kernel), the warm-up's seconds, and its distance to ``bf16-eager``: the final
latents' and the decoded image's (8-bit pixels) largest absolute difference, relative L2 distance
and, for the image, PSNR. Compiled rows also give ``vs_no_graphs``: the latents' largest difference
from the same compiled (quantized, cached) pipeline with its graphs switched off, 0 when bit-equal.
``--fp8-backend scaled-mm`` swaps torchao's tensor subclass for the opaque ``scaled_mm`` op
(accel/hooks/scaled_mm.py). Writes ``results.json`` and ``results.md`` to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchkit.calls import register_recipes
from benchkit.environment import collect_env
from benchkit.settings import parse_resolution, res_name

from accel.hooks import quantizers
from accel.hooks.scaled_mm import ScaledMMFloat8

MODELS = ("z-image", "qwen-image")
VARIANTS = ("bf16-eager", "bf16-compiled-graphs", "fp8-compiled-graphs", "fp8-dbcache-compiled-graphs")
BACKENDS: dict[str, Any] = {"torchao": quantizers.TorchAOFloat8, "scaled-mm": ScaledMMFloat8}
PROMPT = "a red fox standing in fresh snow at dawn, soft golden light, highly detailed photograph"
NEGATIVE = "blurry, low quality, watermark"
STEPS = {"z-image": 9, "qwen-image": 20}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
        self.ref: dict[str, torch.Tensor] = {}
        self.pipe: Any = None

    def build(self) -> None:
        from pipelines.builders import build_pipeline

        self.pipe = None
        if self.cuda:
            torch.cuda.empty_cache()
        say(f"building {self.model} ({self.args.size}) on {self.device}")
        # bf16 everywhere: quantize="fp8" makes its float8 weights from bf16 ones.
        self.pipe = build_pipeline(self.model, self.args.size, device=self.device, dtype=torch.bfloat16, seed=0)
        self.pipe.set_progress_bar_config(disable=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(prompt=PROMPT, width=self.wh[0], height=self.wh[1], num_inference_steps=self.steps)
        if self.model == "qwen-image":
            kw.update(negative_prompt=NEGATIVE, true_cfg_scale=4.0)
        else:
            kw.update(guidance_scale=0.0)
        return kw

    def generate(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(seconds, final latents, decoded 8-bit pixels) of one call."""
        latents: list[torch.Tensor] = []

        def keep(pipe: Any, i: int, t: Any, kw: dict) -> dict:
            if i == self.steps - 1:
                latents.append(kw["latents"].detach().float().clone())
            return {}

        self.sync()
        t0 = time.perf_counter()
        out = self.pipe(
            **self.kwargs(),
            generator=torch.Generator(self.device).manual_seed(0),
            callback_on_step_end=keep,
            output_type="pil",
        )
        self.sync()
        return time.perf_counter() - t0, latents[0], pixels(out.images)

    def enable_dbcache(self) -> None:
        import cache_dit

        qwen = self.model == "qwen-image"
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            max_warmup_steps=8 if qwen else 4,
            max_continuous_cached_steps=3,
            max_cached_steps=-1 if qwen else 3,
            residual_diff_threshold=100.0,
        )
        cache_dit.enable_cache(self.pipe, cache_config=config)

    def accelerate(self, quantize: bool) -> dict[str, Any]:
        from accel import accelerate_pipeline

        t0 = time.perf_counter()
        options: dict[str, Any] = dict(compile=True)
        if quantize:
            options.update(quantize="fp8", fp8_budget=self.args.fp8_budget)
        accelerate_pipeline(self.pipe, **options)
        qwen = self.model == "qwen-image"
        report = self.pipe.accel.warmup(
            [self.wh],
            prompts=[PROMPT],
            negative_prompt=NEGATIVE if qwen else None,
            cfg=qwen,
            num_inference_steps=2,
            progress=False,
        )
        row: dict[str, Any] = dict(
            setup_s=round(time.perf_counter() - t0, 2),
            capture_s=round(report.total_seconds, 2),
            compile_s=round(report.total_compile_seconds, 2),
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
                )
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
        name = variant if not variant.startswith("fp8") or backend == "torchao" else f"{variant}[{backend}]"
        row: dict[str, Any] = {"model": self.model, "variant": name, "resolution": res_name(self.wh)}
        cached = "dbcache" in variant
        try:
            if cached:
                self.enable_dbcache()
            if variant != "bf16-eager":
                row.update(self.accelerate(quantize=variant.startswith("fp8")))
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
        except Exception as exc:  # one row's failure must not cost the others
            import traceback

            traceback.print_exc()
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:600])
        finally:
            if "accel" in vars(self.pipe):
                self.pipe.accel.restore()  # float8 layers stay float8: quantize= is one-way
            if cached:
                import cache_dit

                with contextlib.suppress(Exception):
                    cache_dit.disable_cache(self.pipe)
            if self.cuda:
                torch.cuda.empty_cache()
        say(json.dumps({k: v for k, v in row.items() if k != "report"}))
        return row


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}, torchao {env.get('torchao')}, "
        f"cache-dit {env.get('cache_dit')}, commit {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}, "
        f"{env['date']}; {args.size} size, end to end (decoded to PIL), median of {args.runs}; fp8_budget "
        f"{args.fp8_budget}",
        "",
        "| model | variant | res | s | x bf16 eager | setup s | latents max abs / rel | image max abs / rel / PSNR "
        "| vs no graphs | layers fp8 / bf16 | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {(r["model"], r["resolution"]): r.get("seconds") for r in rows if r["variant"] == "bf16-eager"}
    for r in rows:
        s, base = r.get("seconds"), eager.get((r["model"], r["resolution"]))
        lat, img, sel = r.get("latents") or {}, r.get("image") or {}, r.get("selection") or {}
        layers = f"{sel['quantized']} / {sel['kept_by_recipe'] + len(sel['kept_measured'])}" if sel else ""
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['resolution']} | {s or ''} | "
            f"{f'{base / s:.2f}' if s and base else ''} | {r.get('setup_s', '')} | "
            f"{lat.get('max_abs', '')} / {lat.get('rel_l2', '')} | "
            f"{img.get('max_abs', '')} / {img.get('rel_l2', '')} / {img.get('psnr_db', '')} | "
            f"{r.get('vs_no_graphs', '')} | {layers} | {r['status']} {r.get('reason', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--fp8-backend", nargs="+", choices=sorted(BACKENDS), default=["torchao"])
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--resolution", type=parse_resolution, default=(1024, 1024))
    p.add_argument("--steps", type=int, default=None, help="default: 9 (Z-Image), 20 (Qwen-Image)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fp8-budget", type=float, default=None, help="default: the library's")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    if args.fp8_budget is None:
        from accel.hooks.options import DEFAULT_FP8_BUDGET

        args.fp8_budget = DEFAULT_FP8_BUDGET
    register_recipes()
    device = torch.device("cuda" if torch.cuda.is_available() and args.size == "full" else "cpu")
    env = collect_env(device)
    for package in ("torchao", "cache-dit"):
        with contextlib.suppress(Exception):
            import importlib.metadata

            env[package.replace("-", "_")] = importlib.metadata.version(package)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    md = ""

    def write(row: dict[str, Any]) -> None:
        nonlocal md
        rows.append(row)
        # After every row: a run cut off by a time limit keeps what it measured.
        shown = vars(args) | {"resolution": res_name(args.resolution)}
        (out / "results.json").write_text(json.dumps({"env": env, "args": shown, "rows": rows}, indent=1, default=str))
        md = markdown(env, args, rows)
        (out / "results.md").write_text(md)

    for model in args.only:
        bench = Bench(args, model)
        bench.build()
        for variant in (v for v in args.variants if v.startswith("bf16")):
            write(bench.run(variant, "bf16"))
        for i, backend in enumerate(args.fp8_backend):
            if i:
                bench.build()  # the previous backend's float8 layers stay: a fresh bf16 model
            original = quantizers.QUANTIZERS["fp8"]
            quantizers.QUANTIZERS["fp8"] = BACKENDS[backend]
            try:
                for variant in (v for v in args.variants if v.startswith("fp8")):
                    write(bench.run(variant, backend))
            finally:
                quantizers.QUANTIZERS["fp8"] = original
        bench.pipe = None
    print(md)


if __name__ == "__main__":
    main()
