"""The command line of scripts/bench_lora_switch.py and its loop over models: per model the
LoRA files, the pipeline, every variant, the checks; lora.json and lora.md after every variant."""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .calls import register_recipes
from .environment import collect_env
from .lora_bench import LoraBench, error_row
from .lora_files import TARGETS
from .lora_report import checks, header, markdown
from .settings import PROMPT, SEED, ZIMAGE_STEPS, parse_resolution, res_name, say

MODELS = ("z-image", "qwen-image")
VARIANTS = ("plain", "hot-swap", "switch-back", "recapture")
REFERENCES = ("stock", "no-graphs", "none")
# The settings: Z-Image Turbo at 1024x1024, 9 steps; Qwen-Image at 512x512, 20 steps, true CFG.
DEFAULT_RESOLUTION = {"z-image": (1024, 1024), "qwen-image": (512, 512)}
DEFAULT_STEPS = {"z-image": ZIMAGE_STEPS, "qwen-image": 20}


def _resolution(text: str) -> tuple[int, int]:
    return parse_resolution(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _names(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--models", type=_names(MODELS, "model"), default=list(MODELS), help="comma-separated: z-image, qwen-image"
    )
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on a CPU")
    p.add_argument(
        "--resolution", type=_resolution, default=None, help="N or WxH; default 1024 (Z-Image), 512 (Qwen-Image)"
    )
    p.add_argument("--steps", type=_positive, default=None, help="default 9 (Z-Image), 20 (Qwen-Image, true CFG)")
    p.add_argument("--rank", type=_positive, default=16, help="rank of every LoRA (and enable_lora_hotswap's target)")
    p.add_argument(
        "--variants",
        type=_names(VARIANTS, "variant"),
        default=list(VARIANTS),
        help="comma-separated, run in this order (plain, the floor, always first)",
    )
    p.add_argument("--repeats", type=_positive, default=2, help="timed samples per variant (medians)")
    p.add_argument(
        "--reference",
        choices=REFERENCES,
        default="stock",
        help="what each variant's image is compared with: a stock pipeline given the same changes (default), the "
        "same pipeline with its graphs off, or nothing",
    )
    p.add_argument(
        "--exact-text",
        action="store_true",
        help="text_buckets=None: Qwen-Image's text unpadded, bit for bit with stock",
    )
    p.add_argument("--out", required=True, help="folder for lora.json and lora.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda for --size full, else cpu")
    args = p.parse_args(argv)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    args.device = torch.device(args.device or ("cuda" if args.size == "full" else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: use --size tiny on a CPU")
    if args.size == "full" and args.device.type != "cuda":
        p.error("--size full needs a CUDA device (use --size tiny on a CPU)")
    if "plain" in args.variants:  # the floor first: every other variant's cost is read against it
        args.variants = ["plain", *[v for v in args.variants if v != "plain"]]
    return args


def run(args: argparse.Namespace) -> int:
    """Every model of ``args``; the exit status (1: an asserted check failed)."""
    register_recipes()
    env = collect_env(args.device)
    with contextlib.suppress(Exception):
        import importlib.metadata

        env["peft"] = importlib.metadata.version("peft")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(header(env))
    results: list[dict[str, Any]] = []

    def save() -> None:
        # After every variant: a run cut off by a time limit keeps what it measured.
        (out / "lora.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
        (out / "lora.md").write_text(markdown(env, results))

    for model in args.models:
        wh, steps = args.resolution or DEFAULT_RESOLUTION[model], args.steps or DEFAULT_STEPS[model]
        settings = {
            "size": args.size,
            "resolution": res_name(wh),
            "steps": steps,
            "rank": args.rank,
            "repeats": args.repeats,
            "reference": args.reference,
            "exact_text": args.exact_text,
            "targets": list(TARGETS),
            "prompt": PROMPT,
            "seed": SEED,
        }
        result: dict[str, Any] = {"model": model, "settings": settings, "setup": {}, "rows": [], "checks": []}
        results.append(result)
        with tempfile.TemporaryDirectory(prefix="bcg-lora-") as folder, warnings.catch_warnings():
            # peft's note that a model gets a second adapter: several are what this asks for.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            bench = None
            try:
                bench = LoraBench(args, model, wh, steps, Path(folder))
                result["setup"] = bench.setup()
                for variant in args.variants:
                    result["rows"].append(bench.run(variant))
                    save()
            except Exception as exc:  # one model's failure must not cost the others
                import traceback

                traceback.print_exc()
                result["rows"].append(error_row(model, "setup", exc))
            finally:
                if bench is not None:
                    bench.close()
        result["checks"] = checks(result["rows"], bool(result["setup"].get("graphs")))
        save()
    print(markdown(env, results))
    failed = any(c["asserted"] and not c["ok"] for r in results for c in r["checks"])
    return 1 if failed else 0
