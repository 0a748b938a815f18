"""The measuring run over models and resolutions, and ``save`` (results.json, results.md, plots)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .calls import register_recipes
from .cli import CompileCache
from .environment import collect_env
from .measure import Clock, free_memory
from .model_bench import ModelBench
from .plots import write_plots
from .registry import COMPILED, REGISTRY
from .report import write_markdown
from .rows import CaseRow, err_text, jsonable, rnd
from .settings import SEED, T_START, MiB, config_constants, res_name, say


def save(results: dict[str, Any], out: Path, plots: bool) -> None:
    """results.json (written whole, then renamed), results.md and, when asked, the plots. The
    report and the plots read the results' JSON form, measured or merged alike."""
    if "runs" not in results:  # a merge keeps its runs' own times
        results["elapsed_s"] = rnd(time.perf_counter() - T_START, 1)
    data = json.loads(json.dumps(results, default=jsonable))
    if plots:
        results["plots"] = data["plots"] = write_plots(data, out)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out / "results.json")
    write_markdown(data, out / "results.md")


def quiet_libraries(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import diffusers.utils.logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()


def measure(args: argparse.Namespace, cache: CompileCache) -> int:
    """Every model, resolution and variant of ``args`` (resolved); results under ``args.out``."""
    quiet_libraries(args.verbose)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    clock = Clock(device)

    from pipelines.builders import build_pipeline, canonical_name, describe

    register_recipes()
    args.models = list(dict.fromkeys(canonical_name(m) or m for m in args.models))
    env = collect_env(device)
    config = dict(vars(args))
    config["resolutions"] = [res_name(r) for r in args.resolutions]
    config["e2e_resolutions"] = [res_name(r) for r in args.e2e_resolutions]
    config.update(config_constants())
    config["compile_cache_state"] = cache.state  # of the folder --compile-cache names (None: a fresh one)
    results: dict[str, Any] = {"env": env, "config": config, "models": {}, "cases": [], "memory_series": []}
    compiles = " | compile cache " + cache.state if any(v in args.variants for v in COMPILED) else ""
    say(
        f"device {env['device_name']} | torch {env['torch']} | diffusers {env['diffusers']} | "
        f"transformers {env['transformers']} | variants {' '.join(args.variants)} | "
        f"resolutions {' '.join(config['resolutions'])} | e2e at {' '.join(config['e2e_resolutions']) or 'none'}"
        f"{compiles}"
    )

    for model in args.models:
        t_model = time.perf_counter()
        pipe = bench = None
        try:
            pipe = build_pipeline(model, size=args.size, device=device, dtype=dtype, seed=SEED)
            pipe.set_progress_bar_config(disable=True)
            results["models"][model] = {"describe": describe(pipe), "build_s": rnd(time.perf_counter() - t_model, 1)}
            say(f"built {describe(pipe)} in {time.perf_counter() - t_model:.1f} s")
        except Exception as exc:
            traceback.print_exc()
            reason = f"building the pipeline failed: {err_text(exc)}"
            for wh in args.resolutions:
                for v in args.variants:
                    row = CaseRow.new(model, wh, v)
                    row.fail("error", reason)
                    results["cases"].append(row)
            save(results, out, plots=False)
            pipe = None
            free_memory(clock)
            continue
        try:
            bench = ModelBench(pipe, model, args, device, REGISTRY)
            for wh in args.resolutions:
                t_case = time.perf_counter()
                results["cases"].extend(bench.run_case(wh))
                say(f"{model} {res_name(wh)}: case done in {time.perf_counter() - t_case:.1f} s")
                save(results, out, plots=False)
            results["memory_series"].extend(bench.memory_series())
        finally:
            del bench, pipe
            with contextlib.suppress(Exception):
                from torch import _dynamo

                _dynamo.reset()
            free_memory(clock)
            if clock.cuda:
                say(f"freed {model}: {torch.cuda.memory_allocated(device) / MiB:.0f} MiB still allocated")
        results["models"][model]["total_s"] = rnd(time.perf_counter() - t_model, 1)
        say(f"{model}: done in {time.perf_counter() - t_model:.1f} s")
        save(results, out, plots=True)

    save(results, out, plots=True)
    say(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots; total {time.perf_counter() - T_START:.1f} s")
    return 0
