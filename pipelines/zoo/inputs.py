"""Random, seeded call inputs of a zoo family: what its own text encoders would have produced.

Values are drawn on the CPU from one seeded generator, in the order the family declares them,
then moved, so a seed gives the same inputs on every device. A padded mask marks a random number
of leading tokens of each row as real (at least a quarter of them), as a tokenizer pads a prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from ..construction import as_dtype
from .registry import family
from .spec import Embedding, check_size

__all__ = ["call_inputs", "call_kwargs", "embeddings"]

_MASK_DTYPES = {"mask_int": torch.int64, "mask_bool": torch.bool}


def _tensor(spec: Embedding, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if spec.kind == "embed":
        return torch.randn(spec.shape, generator=gen).to(device, dtype)
    if spec.kind == "mask_ones":
        return torch.ones(spec.shape, dtype=torch.int64, device=device)
    if spec.kind not in (*_MASK_DTYPES, "mask_float"):
        raise ValueError(
            f"Embedding.kind must be 'embed', 'mask_int', 'mask_bool', 'mask_float' or 'mask_ones', got {spec.kind!r}"
        )
    *rows, length = spec.shape
    real = torch.randint(max(1, length // 4), length + 1, tuple(rows), generator=gen)
    mask = torch.arange(length) < real.unsqueeze(-1)
    return mask.to(device, _MASK_DTYPES.get(spec.kind, dtype))


def embeddings(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The prompt embeddings (and masks, pooled embeddings) of family ``name`` at ``size``."""
    specs = family(name).embeddings[check_size(size)]
    gen = torch.Generator().manual_seed(seed)
    target, dtype = torch.device(device), as_dtype(dtype)
    return {k: _tensor(spec, gen, target, dtype) for k, spec in specs.items()}


def _image(height: int, width: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(np.asarray(pixels.numpy()))


def call_inputs(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """What a call of family ``name`` passes besides its geometry and step count: the embeddings,
    the input image of edit pipelines, guidance and the family's further keywords."""
    fam = family(name)
    out: dict[str, Any] = embeddings(name, size, device, dtype, seed)
    if fam.image is not None:
        geo = fam.geometry[size]
        out[fam.image] = _image(geo.height, geo.width, seed)
    out.update(fam.guidance)
    out.update(fam.extras.get(size, {}))
    return out


def call_kwargs(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    steps: int | None = None,
) -> dict[str, Any]:
    """Keywords of one call of family ``name`` at its usual geometry: :func:`call_inputs` plus
    height, width, frames (video) and ``steps`` (default: the family's usual count). The caller
    adds ``generator`` and ``output_type``."""
    fam = family(name)
    out = call_inputs(name, size, device, dtype, seed)
    out.update(fam.geometry[check_size(size)].as_kwargs())
    out["num_inference_steps"] = fam.steps if steps is None else steps
    return out
