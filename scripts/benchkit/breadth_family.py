"""The child of scripts/bench_breadth.py: one family built and measured in this process, every
variant, its result file rewritten after each."""

from __future__ import annotations

import argparse
import datetime
import json
import time
import traceback
from pathlib import Path
from typing import Any

from .breadth_calls import Runner
from .breadth_variants import accelerated_variant, compiled_variant
from .rows import err_text, failed, rnd
from .settings import ROOT, say


def _describe_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = type(v).__name__
    return out


def run_family(name: str, args: argparse.Namespace, result_path: Path) -> int:
    """Measure family ``name`` in this process; the result file is rewritten after every variant."""
    import torch

    from pipelines import zoo

    from .environment import collect_env
    from .run import quiet_libraries

    quiet_libraries(verbose=True)  # the child's log is a file of its own; progress goes to stdout
    if args.threads:
        torch.set_num_threads(args.threads)
    _register_project_recipes()
    fam, device = zoo.family(name), torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    geo = fam.geometry[args.size]
    row: dict[str, Any] = {
        "name": name,
        "pipeline": fam.pipeline,
        "released": fam.released,
        "size": args.size,
        "device": args.device,
        "dtype": args.dtype,
        "geometry": {"width": geo.width, "height": geo.height, "frames": geo.frames},
        "usual_steps": fam.steps,
        "measured_steps": list(args.steps),
        "cfg": fam.cfg,
        "guidance": dict(fam.guidance),
        "classes": {fam.denoiser: fam.denoiser_class, "vae": fam.vae_class, "scheduler": fam.scheduler_class},
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": "running",
        "variants": {},
        "env": collect_env(device),
    }

    def save() -> None:
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1, default=str))
        tmp.replace(result_path)

    t0 = time.perf_counter()
    try:
        pipe = zoo.build(name, args.size, device=device, dtype=dtype, seed=args.seed)
        row["build_s"] = rnd(time.perf_counter() - t0, 2)
        row["params"] = {k: sum(p.numel() for p in getattr(pipe, k).parameters()) for k in (fam.denoiser, "vae")}
        row["absent"] = zoo.absent_components(fam)
        inputs = zoo.call_inputs(name, args.size, device=device, dtype=dtype, seed=args.seed)
        row["inputs"] = _describe_inputs(inputs)
        n = row["params"][fam.denoiser]
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        say(f"{name}: built {fam.pipeline} ({size} denoiser parameters) in {row['build_s']} s")
        save()
        runner = Runner(pipe, fam, args, inputs)
        row["variants"]["eager"] = runner.timed("eager")
        eager = runner.latents
        save()
        if "graphs" in args.variants:
            row["variants"]["graphs"] = _variant(lambda: accelerated_variant(runner, eager, "graphs"), pipe)
            save()
        if "compiled" in args.variants:
            row["variants"]["compiled"] = _variant(lambda: compiled_variant(runner, eager), pipe)
            save()
        row["status"] = "ok"
    except Exception as exc:
        failed(row, exc)
    row["wall_s"] = rnd(time.perf_counter() - t0, 1)
    save()
    return 0 if row["status"] == "ok" else 1


def _variant(fn: Any, pipe: Any) -> dict[str, Any]:
    """One accelerated variant; an exception is its row's error (the next variant still runs), and
    the pipeline is restored either way, its graph memory given back first."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {"status": "error", "reason": err_text(exc)}
    finally:
        if "accel" in pipe.__dict__:
            pipe.accel.release()
            pipe.accel.restore()


def _register_project_recipes() -> None:
    """The recipes pyproject.toml declares, registered by hand: a plain checkout (PYTHONPATH, no
    ``pip install -e .``) has no entry points, or those of another checkout."""
    from .calls import register_recipes

    try:
        import importlib

        import tomllib

        from accel import register_recipe

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        for target in project["project"]["entry-points"]["bcg_diffusers.recipes"].values():
            module, _, attr = target.partition(":")
            register_recipe(getattr(importlib.import_module(module), attr))
    except Exception as exc:  # Python 3.10 has no tomllib: the bench's own list
        say(f"warning: could not register pyproject.toml's recipes ({err_text(exc)}); registering the known ones")
        register_recipes()
