"""The command line of scripts/bench_fp8.py and its run: per model the bf16 rows, then each float8
backend's rows on a fresh bf16 model; results.json and results.md after every row."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accel import recipe_for
from accel.hooks.fp8 import ScaledMMFloat8, layer_kinds, quantizers

from .calls import register_recipes
from .environment import collect_env
from .fp8_bench import Bench
from .settings import parse_resolution, res_name

MODELS = ("z-image", "qwen-image", "qwen-image-2.1")
# bf16-graphs: graphs without compile, against bf16-eager (bit for bit where the recipe promises it).
# The -fa3- rows: attention="fa3" (FlashAttention-3); the float8 one on a freshly built model.
VARIANTS = (
    "bf16-eager",
    "bf16-graphs",
    "bf16-compiled-graphs",
    "bf16-fa3-compiled-graphs",
    "fp8-compiled-graphs",
    "fp8-fa3-compiled-graphs",
    "fp8-dbcache-compiled-graphs",
)
DEFAULT_MODELS = ("z-image", "qwen-image")
DEFAULT_VARIANTS = ("bf16-eager", "bf16-compiled-graphs", "fp8-compiled-graphs", "fp8-dbcache-compiled-graphs")
BACKENDS: dict[str, Any] = {"torchao": quantizers.TorchAOFloat8, "scaled-mm": ScaledMMFloat8}


@contextlib.contextmanager
def fp8_backend(name: str) -> Iterator[None]:
    """``quantize="fp8"`` takes the float8 layers of ``name`` (a :data:`BACKENDS` key) inside,
    whatever the recipe names; ``"default"``: the library's choice (the recipe's ``fp8_layers``)."""
    if name == "default":
        yield
        return
    original = quantizers.QUANTIZERS["fp8"], layer_kinds.FP8_LAYERS
    quantizers.QUANTIZERS["fp8"] = BACKENDS[name]
    layer_kinds.FP8_LAYERS = dict.fromkeys(original[1], BACKENDS[name])
    try:
        yield
    finally:
        quantizers.QUANTIZERS["fp8"], layer_kinds.FP8_LAYERS = original


def recipe_of(pipe: Any) -> type:
    """The recipe class serving ``pipe``'s denoiser."""
    return recipe_for(getattr(pipe, "transformer", None) or getattr(pipe, "unet", None))


@contextlib.contextmanager
def forms_flipped(recipe: type, flags: list[str]) -> Iterator[str]:
    """``recipe`` (a class: :func:`recipe_of`) with each of ``flags`` (boolean class attributes
    naming a compiled form, e.g. ``fused_head_norms``) set to the other value inside: the same rows
    with those forms on where the recipe has them off, and off where on. Yields the rows' label.
    It takes the class, not a pipeline: a rebuild inside must not find the old model still held."""
    missing = [f for f in flags if not isinstance(getattr(recipe, f, None), bool)]
    if missing:
        raise SystemExit(f"--form-flip: {recipe.__name__} has no form flag {', '.join(missing)}")
    saved = {f: getattr(recipe, f) for f in flags}
    for f, value in saved.items():
        setattr(recipe, f, not value)
    try:
        yield ", ".join(f"{f} {'off' if value else 'on'}" for f, value in saved.items())
    finally:
        for f, value in saved.items():
            setattr(recipe, f, value)


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
        if sel.get("attention_fp8") or sel.get("attention_kept"):
            layers += f"; attention {sel['attention_fp8']} / {len(sel['attention_kept'])}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['resolution']} | {s or ''} | "
            f"{f'{base / s:.2f}' if s and base else ''} | {r.get('setup_s', '')} | "
            f"{lat.get('max_abs', '')} / {lat.get('rel_l2', '')} | "
            f"{img.get('max_abs', '')} / {img.get('rel_l2', '')} / {img.get('psnr_db', '')} | "
            f"{r.get('vs_no_graphs', '')} | {layers} | {r['status']} {r.get('reason', '')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--only", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument(
        "--fp8-backend",
        nargs="+",
        choices=["default", *sorted(BACKENDS)],
        default=["default"],
        help="float8 layers: the library's choice for the model (default), or one kind for every model",
    )
    p.add_argument(
        "--form-flip",
        nargs="+",
        default=[],
        metavar="FLAG",
        help="after the float8 backends' rows, the first backend's again on a fresh model with these recipe "
        "flags (compiled forms, e.g. fused_head_norms) set the other way: a form's gain in one process",
    )
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--resolution", type=parse_resolution, default=(1024, 1024))
    p.add_argument("--steps", type=int, default=None, help="default: 9 (Z-Image), 20 (Qwen-Image), 40 (Qwen-Image 2.1)")
    p.add_argument(
        "--true-cfg",
        type=float,
        default=None,
        help="Qwen-Image 2.1's true_cfg_scale (default: none, as Qwen recommends; above 1 adds the negative prompt)",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fp8-budget", type=float, default=None, help="default: the library's")
    p.add_argument(
        "--cold",
        action="store_true",
        help="every compiled row on a freshly built bf16 model with dynamo reset and an empty inductor cache "
        "(setup seconds comparable between rows of one run)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    if args.fp8_budget is None:
        from accel.hooks.options import DEFAULT_FP8_BUDGET

        args.fp8_budget = DEFAULT_FP8_BUDGET
    return args


def run(args: argparse.Namespace) -> None:
    """Every model of ``args``; the last table printed."""
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
        built = True  # the model as built, nothing compiled or quantized yet
        for variant in (v for v in args.variants if v.startswith("bf16")):
            if args.cold and variant != "bf16-eager" and not built:
                bench.build()
            write(bench.run(variant, "bf16"))
            built = built and variant == "bf16-eager"
        runs = [(b, []) for b in args.fp8_backend]
        if args.form_flip:
            runs.append((args.fp8_backend[0], args.form_flip))
        for i, (backend, flip) in enumerate(runs):
            if i or (args.cold and not built):
                bench.build()  # the previous backend's float8 layers stay: a fresh bf16 model
            with fp8_backend(backend), forms_flipped(recipe_of(bench.pipe), flip) as flipped:
                label = f"{backend}, {flipped}" if flip else backend
                for j, variant in enumerate(v for v in args.variants if v.startswith("fp8")):
                    if j and (args.cold or "-fa3-" in variant):
                        # Measured again (FlashAttention-3's float8 attention is chosen by the
                        # measurement), compiled cold: not the last row's float8 model.
                        bench.build()
                    write(bench.run(variant, label))
            built = False
        bench.pipe = None
    print(md)
