"""Constants of the benchmark, resolutions, how each model is run, progress lines."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

STATUSES = ("ok", "skipped", "error")
PROMPT = "a red fox standing in fresh snow at dawn, soft golden light, highly detailed photograph"
NEGATIVE = "blurry, low quality, watermark"
SEED = 0
ZIMAGE_STEPS = 9
QWEN_TRUE_CFG = 4.0
OMNI_GUIDANCE = 5.0  # ZImageOmniPipeline's default guidance_scale
MiB = 2**20
PLOTS = ("step_time.png", "graph_memory.png")

T_START = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def say_clock(msg: str) -> None:
    """A progress line stamped with the time of day (scripts/bench_caches.py, scripts/bench_fp8.py)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_resolution(text: str) -> tuple[int, int]:
    """ "512" -> (512, 512); "768x512" -> (768, 512) (width x height)."""
    try:
        if "x" in text.lower():
            w, h = (int(v) for v in text.lower().split("x"))
        else:
            w = h = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a resolution is N or WxH, got {text!r}") from None
    if w <= 0 or h <= 0 or w % 16 or h % 16:
        raise argparse.ArgumentTypeError(f"{text}: width and height must be positive multiples of 16")
    return w, h


def res_name(wh: tuple[int, int]) -> str:
    return f"{wh[0]}x{wh[1]}"


def by_area(wh: tuple[int, int]) -> tuple[int, int]:
    return wh[0] * wh[1], wh[0]


# ------------------------------------------------------------------------------------------------
# How each model is run
# ------------------------------------------------------------------------------------------------
def uses_cfg(model: str) -> bool:
    # Z-Image runs as Turbo: guidance 0. Z-Image Omni (Omni-Base) runs guided, both branches in one
    # denoiser call of batch 2; Qwen-Image's true CFG makes two calls.
    return model in ("qwen-image", "z-image-omni")


def steps_of(model: str, args: argparse.Namespace) -> int:
    return ZIMAGE_STEPS if model == "z-image" else args.steps_e2e


def calls_per_step(model: str) -> int:
    return 2 if model == "qwen-image" else 1


def pipe_kwargs(model: str, wh: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    return call_kwargs(model, wh, steps_of(model, args))


def call_kwargs(model: str, wh: tuple[int, int], steps: int, true_cfg: float | None = None) -> dict[str, Any]:
    """The benchmarks' call of ``model`` at ``wh`` (width, height): Z-Image as Turbo, Z-Image Omni
    (text to image) guided, Qwen-Image with true CFG, Qwen-Image 2.1 as Qwen recommends it (no
    guidance, its prefix K/V cache on) unless ``true_cfg`` is above 1 (then with the negative prompt)."""
    kw: dict[str, Any] = dict(prompt=PROMPT, width=wh[0], height=wh[1], num_inference_steps=steps)
    if model == "z-image":
        kw["guidance_scale"] = 0.0
    elif model == "z-image-omni":
        kw.update(negative_prompt=NEGATIVE, guidance_scale=OMNI_GUIDANCE)
    elif model == "qwen-image":
        kw.update(negative_prompt=NEGATIVE, true_cfg_scale=QWEN_TRUE_CFG)
    elif model == "qwen-image-2.1" and true_cfg is not None and true_cfg > 1:
        kw.update(negative_prompt=NEGATIVE, true_cfg_scale=true_cfg)
    return kw


def config_constants() -> dict[str, Any]:
    """What every run writes into its config beside its options."""
    return dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        seed=SEED,
        zimage_steps=ZIMAGE_STEPS,
        zimage_guidance=0.0,
        qwen_true_cfg_scale=QWEN_TRUE_CFG,
        omni_guidance=OMNI_GUIDANCE,
    )
