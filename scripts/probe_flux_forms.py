#!/usr/bin/env python
"""Probe: which compiled forms bring FLUX.1-dev's compiled graphs under 3.7 s end to end.

    python scripts/probe_flux_forms.py --out out/flux-forms        # CUDA, full size, ~3 minutes

One process, full-size FLUX.1-dev (random weights, random embeddings), 1024x1024, 28 steps,
guidance 3.5, decoded (``output_type="pt"``). Variants side by side, each a median of
``--repeats`` whole calls after an untimed one:

* ``eager``: the stock pipeline;
* ``compiled``: ``accelerate_pipeline(pipe, compile=True)`` as it is: FLUX.1's single-stream
  form (pipelines/families/flux/forms.py) and the decoder's GroupNorms through inductor
  (accel/hooks/compiled/group_norm.py);
* ``compiled-stock-single``: the same with the single-stream blocks as diffusers wrote them;
* ``compiled-stock-norms``: the same with the decoder's GroupNorms as ATen's;
* ``compiled+vae``: ``compiled`` and the whole VAE decoder's forward compiled by inductor
  (static shapes; CUDA only);
* ``fused-qkv``: ``compiled`` after diffusers' ``transformer.fuse_qkv_projections()``;
* ``fused-qkv+vae``: and the VAE decoder compiled.

Each compiled variant's graphs are compared bit for bit with the same compiled model with its
runners off. Writes ``flux-forms.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def fused(model) -> bool:
    """Whether any attention module of ``model`` runs diffusers' fused projections."""
    return any(getattr(m, "fused_projections", False) for m in model.modules())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="eager,compiled,compiled-stock-single,compiled-stock-norms,compiled+vae")
    p.add_argument("--size", default="full", choices=("full", "tiny"), help="tiny: a CPU smoke run (nothing compiles)")
    args = p.parse_args()
    import torch
    from benchkit.calls import register_recipes, uncompile
    from benchkit.environment import collect_env

    from accel import accelerate_pipeline
    from accel.hooks import graph_hook
    from pipelines import zoo
    from pipelines.families.flux.recipe import FluxRecipe

    register_recipes()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fam = zoo.family("flux")
    geo = fam.geometry[args.size]
    pipe = zoo.build("flux", args.size, device=dev, dtype=dtype, seed=0)
    pipe.set_progress_bar_config(disable=True)
    inputs = zoo.call_inputs("flux", args.size, device=dev, dtype=dtype, seed=0)
    from accel.hooks.recipes import WARMUP_ARGUMENTS

    given = {k: v for k, v in inputs.items() if k not in WARMUP_ARGUMENTS}
    result: dict = {"env": collect_env(dev), "steps": fam.steps, "variants": {}}

    def call(steps: int = 2 if args.size == "tiny" else fam.steps):
        gen = torch.Generator(dev).manual_seed(0)
        return pipe(**inputs, **geo.as_kwargs(), num_inference_steps=steps, output_type="pt", generator=gen)[0][0]

    def timed(label: str) -> torch.Tensor:
        call()
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            img = call()
            sync()
            times.append(time.perf_counter() - t0)
        row = result["variants"].setdefault(label, {})
        row.update(seconds=[round(t, 4) for t in times], median_s=round(statistics.median(times), 4))
        print(f"{label}: {statistics.median(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)})", flush=True)
        return img.detach().clone()

    def save() -> None:
        (out / "flux-forms.json").write_text(json.dumps(result, indent=1, default=str))

    wanted = args.variants.split(",")
    eager = timed("eager") if "eager" in wanted else None
    save()
    for label in [v for v in wanted if v != "eager"]:
        torch._dynamo.reset()
        stock_decoder_forward = pipe.vae.decoder.__dict__.get("forward")
        norms = [m for m in pipe.vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm)]
        stock_forms, stock_norms = FluxRecipe.compiled_forms, graph_hook.compile_group_norms
        try:
            if "fused-qkv" in label:
                pipe.transformer.fuse_qkv_projections()
            if label.endswith("stock-single"):
                FluxRecipe.compiled_forms = lambda self, module: lambda: None
            if label.endswith("+vae") and dev.type == "cuda":  # inductor on a CPU: minutes, no use
                pipe.vae.decoder.forward = torch.compile(pipe.vae.decoder.forward, fullgraph=True, dynamic=False)
            if label.endswith("stock-norms"):
                graph_hook.compile_group_norms = lambda module, cache_dir=None: lambda: None
            accelerate_pipeline(pipe, compile=True)
            t0 = time.perf_counter()
            pipe.accel.warmup([(geo.width, geo.height)], cfg=fam.cfg, call_kwargs=given, progress=False)
            result["variants"][label] = {"warmup_s": round(time.perf_counter() - t0, 2)}
            img = timed(label)
            stats = pipe.accel.stats()
            runners = list(pipe.accel.runners.values())
            for r in runners:
                r.enabled = False
            try:
                ref = call().detach().clone()
            finally:
                for r in runners:
                    r.enabled = True
            row = result["variants"][label]
            row.update(
                equal_to_compiled_eager=bool(torch.equal(img, ref)),
                max_abs_diff_to_compiled_eager=float((img.float() - ref.float()).abs().max()),
                max_abs_diff_to_stock_eager=None if eager is None else float((img.float() - eager.float()).abs().max()),
                replays={n: s.replays for n, s in stats.items()},
                eager_calls={n: s.eager_calls for n, s in stats.items()},
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
            )
            print(f"{label}: {row}", flush=True)
        except Exception as exc:  # the next variant still runs
            import traceback

            traceback.print_exc()
            result["variants"].setdefault(label, {})["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if "accel" in pipe.__dict__:
                pipe.accel.restore()
            uncompile(pipe.transformer)
            if fused(pipe.transformer):
                pipe.transformer.unfuse_qkv_projections()
            if stock_decoder_forward is None:
                pipe.vae.decoder.__dict__.pop("forward", None)
            FluxRecipe.compiled_forms, graph_hook.compile_group_norms = stock_forms, stock_norms
            result["variants"].setdefault(label, {})["given_back"] = not (
                fused(pipe.transformer)
                or "forward" in vars(pipe.vae.decoder)
                or any("forward" in vars(m) for m in norms)
                or any("forward" in vars(b) for b in pipe.transformer.single_transformer_blocks)
                or "accel" in pipe.__dict__
            )
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
