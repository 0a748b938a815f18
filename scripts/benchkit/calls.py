"""The pipeline side: recipes, ``accelerate_pipeline``, and step 0's recorded denoiser call."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from accel import tree

from .rows import err_text
from .settings import NEGATIVE, PROMPT, SEED, pipe_kwargs, say


def register_recipes() -> None:
    """Recipes are found through entry points once the project is installed; a plain checkout
    (PYTHONPATH) has none, so register them by hand. Harmless when installed."""
    try:
        from accel import register_recipe
        from pipelines.families.flux.recipe import FluxRecipe
        from pipelines.families.hunyuan_video15.recipe import HunyuanVideo15Recipe
        from pipelines.families.qwen_image.recipe import QwenImageRecipe
        from pipelines.families.qwen_image_21.recipe import QwenImage21Recipe
        from pipelines.families.z_image.recipe import ZImageRecipe

        for recipe in (FluxRecipe, HunyuanVideo15Recipe, QwenImageRecipe, QwenImage21Recipe, ZImageRecipe):
            register_recipe(recipe)
    except Exception as exc:
        say(f"warning: could not register the recipes by hand ({err_text(exc)})")


def accelerate(pipe: Any, **options: Any) -> Any:
    from accel import accelerate_pipeline

    return accelerate_pipeline(pipe, **options)


def warm_up(pipe: Any, sizes: Sequence[tuple[int, int]], cfg: bool, steps: int | None = None) -> Any:
    """``pipe.accel.warmup`` at ``sizes`` with the benches' prompt, and their negative prompt where
    ``cfg``; ``steps`` steps a call (None: the warm-up's own count); no progress bars. Its report."""
    more: dict[str, Any] = {} if steps is None else {"num_inference_steps": steps}
    negative = NEGATIVE if cfg else None
    return pipe.accel.warmup(list(sizes), prompts=[PROMPT], negative_prompt=negative, cfg=cfg, progress=False, **more)


def timed_call(pipe: Any, kwargs: Mapping[str, Any], steps: int, device: Any,
               sync: Callable[[], None]) -> tuple[float, torch.Tensor, Any]:  # fmt: skip
    """One call of ``pipe`` (seed 0, decoded to PIL), from an idle device to its last kernel:
    (seconds, its final latents as an fp32 copy, what it returned)."""
    latents: list[torch.Tensor] = []

    def keep(pipe: Any, i: int, t: Any, kw: dict) -> dict:
        if i == steps - 1:
            latents.append(kw["latents"].detach().float().clone())
        return {}

    sync()
    t0 = time.perf_counter()
    out = pipe(**kwargs, generator=torch.Generator(device).manual_seed(0), callback_on_step_end=keep,
               output_type="pil")  # fmt: skip
    sync()
    return time.perf_counter() - t0, latents[0], out


def denoiser_name(accel: Any) -> str:
    names = list(accel.runners)
    return "transformer" if "transformer" in names else names[0]


def describe_call(args: tuple, kwargs: dict) -> str:
    def d(o: Any) -> str:
        if isinstance(o, torch.Tensor):
            return "x".join(map(str, o.shape)) or "scalar"
        if isinstance(o, (list, tuple)) and o and all(isinstance(t, torch.Tensor) for t in o):
            return "[" + ", ".join(d(t) for t in o) + "]"
        return type(o).__name__ if o is not None else "None"

    parts = [d(a) for a in args] + [
        f"{k}={d(v)}" for k, v in kwargs.items() if isinstance(v, (torch.Tensor, list, tuple))
    ]
    return ", ".join(parts)


def text_tokens(model: str, args: tuple, kwargs: dict) -> int | None:
    if model in ("qwen-image", "flux"):
        t = kwargs.get("encoder_hidden_states")
        return int(t.shape[1]) if isinstance(t, torch.Tensor) else None
    if len(args) >= 3 and isinstance(args[2], list) and args[2] and isinstance(args[2][0], torch.Tensor):
        return int(args[2][0].shape[0])
    return None


class _Stop(Exception):
    pass


def batch_kwargs(
    model: str, wh: tuple[int, int], args: argparse.Namespace, device: torch.device, batch: int = 1
) -> dict[str, Any]:
    """``pipe_kwargs`` with its generator, for a call of ``batch`` images made as the server makes one
    (:mod:`pipelines.serve.engine`) and as ``pipe.accel.warmup`` captures one: a prompt (and negative
    prompt) per image, each image its own generator (seeds ``SEED``, ``SEED + 1``, ...). Batch 1: the
    one prompt and one generator. Fresh lists every time (the pipeline may edit them)."""
    kw = pipe_kwargs(model, wh, args)
    if batch == 1:
        return {**kw, "generator": torch.Generator(device).manual_seed(SEED)}
    for name in ("prompt", "negative_prompt"):
        if name in kw:
            kw[name] = [kw[name]] * batch
    kw["generator"] = [torch.Generator(device).manual_seed(SEED + i) for i in range(batch)]
    return kw


def record_step_calls(
    pipe: Any,
    model: str,
    wh: tuple[int, int],
    args: argparse.Namespace,
    device: torch.device,
    batch: int = 1,
    step: int = 0,
) -> list[tuple[tuple, dict]]:
    """Every ``pipe.transformer`` call of step ``step`` (0 unless said) of a real pipeline run of
    ``batch`` images (:func:`batch_kwargs`), tensors cloned, other arguments shared: a later step's
    calls of Qwen-Image 2.1 keep the prefix K/V cache that its step 0 filled."""
    calls: list[tuple[tuple, dict]] = []
    at = [0]

    def pre_hook(module: Any, a: tuple, k: dict) -> None:
        if at[0] == step:
            calls.append((tree.clone(a), tree.clone(k)))

    def stop(pipe_: Any, i: int, t: Any, cb_kwargs: dict) -> dict:
        at[0] = i + 1
        if i >= step:
            raise _Stop
        return {}

    kwargs = batch_kwargs(model, wh, args, device, batch)
    if kwargs["num_inference_steps"] <= step:
        raise ValueError(f"step {step} of a call of {kwargs['num_inference_steps']} steps")
    handle = pipe.transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(**kwargs, output_type="latent", callback_on_step_end=stop)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not calls:
        raise RuntimeError(f"the pipeline made no transformer call in step {step}")
    return calls


def compiled_blocks(module: torch.nn.Module) -> list[str]:
    """Names of the submodules of ``module`` that run compiled (``nn.Module.compile``, or a forward
    replaced by a ``torch.compile`` wrapper)."""
    names = []
    for name, sub in module.named_modules():
        forward = sub.__dict__.get("forward")
        if getattr(sub, "_compiled_call_impl", None) is not None or hasattr(forward, "_torchdynamo_orig_callable"):
            names.append(name or "(root)")
    return names


def uncompile(module: torch.nn.Module) -> int:
    """Undo ``nn.Module.compile`` on ``module`` and its submodules; returns how many were compiled."""
    n = 0
    for sub in module.modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            sub._compiled_call_impl = None
            n += 1
    return n
