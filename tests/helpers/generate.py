"""One seeded pipeline call, as every test makes it: ``generate(pipe, prompt, size=..., ...)``.

The guidance scale goes to the pipeline under its own argument, as the model's recipe states it
(:class:`accel.GenerationDefaults`: ``true_cfg_scale`` for Qwen-Image, ``guidance_scale`` for
Z-Image); :func:`no_guidance` is the scale at which the pipeline runs without guidance.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.generation.defaults import generation_defaults


def guidance_kwarg(pipe: Any) -> str:
    """The pipeline argument that takes the guidance scale."""
    name = generation_defaults(pipe).guidance_kwarg
    assert name is not None, f"{type(pipe).__name__} takes no guidance scale"
    return name


def no_guidance(pipe: Any) -> float:
    """The guidance scale at which the pipeline runs one branch only (its recipe's threshold)."""
    return generation_defaults(pipe).cfg_above


def generate(
    pipe: Any,
    prompt: str = "a lighthouse in a storm",
    *,
    size: tuple[int, int] = (64, 64),
    steps: int = 2,
    seed: int = 0,
    guidance: float | None = None,
    negative_prompt: str | None = None,
    device: str = "cpu",
    output_type: str = "latent",
    **extra: Any,
) -> torch.Tensor:
    """The images (latents by default) of one call of ``pipe`` seeded with ``seed`` on ``device``.

    ``size`` is ``(width, height)``; ``guidance`` (None: the pipeline's own default) is passed
    under :func:`guidance_kwarg`; ``extra`` goes to the pipeline as it is, after the rest (so it
    may override them).
    """
    kwargs: dict[str, Any] = dict(
        prompt=prompt, width=size[0], height=size[1], num_inference_steps=steps, output_type=output_type
    )
    if negative_prompt is not None:
        kwargs["negative_prompt"] = negative_prompt
    if guidance is not None:
        kwargs[guidance_kwarg(pipe)] = guidance
    kwargs.update(extra)
    return pipe(**kwargs, generator=torch.Generator(device).manual_seed(seed)).images
