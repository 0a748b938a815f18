"""The record each image carries: how it was made (prompt, seed, size, the mode that ran, the
run's settings), and the same as AUTOMATIC1111's ``parameters`` text, which image browsers read.

Both front ends write it: ``bcg-generate`` into its files, ``bcg-serve`` into each answer's image
(:func:`pipelines.generation.formats.encode_image` puts it into PNG text chunks or EXIF).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..lora import LoraSpec, describe_loras
from .constants import package_version

if TYPE_CHECKING:
    from .calls import CallSettings, Job
    from .prompts import TokenCount


def run_text(model: str, device: Any, dtype: Any, call: CallSettings, cache: str | None = None,
             loras: Sequence[LoraSpec] = (), quantize: str | None = None,
             scheduler: str | None = None) -> dict[str, str]:  # fmt: skip
    """The PNG text every image of a run shares: how the calls were made (``cache``: the step
    cache applied, as described when it was; ``loras``: the adapters, by file name and scale;
    ``quantize``: what quantization ran, :func:`quantized`; ``scheduler``: its class name)."""
    text = dict(
        negative_prompt=call.negative_prompt or "",
        steps=str(call.steps),
        guidance="default" if call.guidance is None else f"{call.guidance:g}",
        model=model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        Software=f"bcg-diffusers {package_version()}",
    )
    if scheduler is not None:
        text["scheduler"] = scheduler
    if call.image_note:
        text["input_image"] = call.image_note
    if cache is not None:
        text["cache"] = cache
    if loras:
        text["lora"] = describe_loras(loras)
    if quantize is not None:
        text["quantize"] = quantize
    if call.frames is not None:
        text["frames"] = f"{call.frames} generated, the first written"
    return text


def quantized(pipe: Any) -> str | None:
    """What ``quantize=`` did to ``pipe``'s denoiser, in one line (None where nothing is quantized)."""
    accel = vars(pipe).get("accel")
    quantization = getattr(accel, "quantization", None)
    return quantization.summary() if quantization is not None else None


def image_texts(job: Job, common: Mapping[str, str], mode: str, requested_mode: str,
                tokens: TokenCount | None = None) -> list[dict[str, str]]:  # fmt: skip
    """The PNG text of each image of ``job``: its prompt, seed, size and index, the ``mode`` that
    ran (and the one requested, where another ran), the prompt's ``tokens``, then ``common``
    (:func:`run_text`)."""
    texts = []
    for index, seed in zip(job.indices, job.seeds):
        text = dict(prompt=job.prompt, seed=str(seed), resolution=f"{job.width}x{job.height}", index=str(index),
                    mode=mode)  # fmt: skip
        if mode != requested_mode:
            text["requested_mode"] = requested_mode
        if tokens is not None:
            text["prompt_tokens"] = tokens.describe()
        text.update(common)
        text["parameters"] = parameters(text)
        texts.append(text)
    return texts


def record_size_made(image: Any, job: Job, texts: list[dict[str, str]]) -> tuple[int, int] | None:
    """The records of ``job``'s images made true where the pipeline made another size than asked
    (one that rounds or scales it by its own rule, or takes it from an input image): the size
    made, or None where it is the one asked or ``image`` has no PIL size."""
    made = getattr(image, "size", None)
    if not isinstance(made, tuple) or len(made) != 2 or made == (job.width, job.height):
        return None
    for text in texts:
        text["resolution"] = f"{made[0]}x{made[1]}"
        text["parameters"] = text["parameters"].replace(f"Size: {job.width}x{job.height}", f"Size: {made[0]}x{made[1]}")
    return made[0], made[1]


def parameters(text: Mapping[str, str]) -> str:
    """An image's record as AUTOMATIC1111's web UI writes its ``parameters`` text, which image
    browsers and other UIs read: the prompt, ``Negative prompt: ...``, then ``Key: value`` pairs."""
    fields = [("Steps", text.get("steps")), ("Sampler", text.get("scheduler")), ("CFG scale", text.get("guidance")),
              ("Seed", text.get("seed")), ("Size", text.get("resolution")), ("Model", text.get("model")),
              ("Denoising strength", _strength(text.get("input_image"))), ("Version", text.get("Software"))]  # fmt: skip
    pairs = ", ".join(f"{key}: {_a1111_value(value)}" for key, value in fields if value)
    lines = [text.get("prompt", "")]
    if text.get("negative_prompt"):
        lines.append(f"Negative prompt: {text['negative_prompt']}")
    return "\n".join([*lines, pairs])


def _strength(note: str | None) -> str | None:
    match = re.search(r"strength ([0-9.]+)", note or "")
    return match.group(1) if match else None


def _a1111_value(value: str) -> str:
    # A1111 quotes a value holding its separators, as JSON does a string
    return json.dumps(value, ensure_ascii=False) if any(c in value for c in ",:\n") else value
