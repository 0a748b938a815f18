"""Modules created in place with random weights: dtypes by name, the device and default dtype while
a module is constructed, seeded construction, and a class's constructor defaults.

Shared by the builders of the built-in models (:mod:`pipelines.builders`), the weight counts of the
request limits (:mod:`pipelines.limits`) and the zoo (:mod:`pipelines.zoo`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["as_dtype", "constructing_on", "init_defaults", "seeded"]

M = TypeVar("M", bound=torch.nn.Module)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` ("bfloat16", "torch.float32" or a dtype); ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


@contextlib.contextmanager
def constructing_on(device: str | torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly on ``device`` in ``dtype``.

    Initialising a 20B model on the CPU in fp32 and then moving it would take minutes and twice
    its final memory; constructing in place takes seconds. The global default dtype is restored
    even if construction fails, because it leaks into every later tensor factory call.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def seeded(make: Callable[[], M], device: str | torch.device, dtype: torch.dtype | str, seed: int) -> M:
    """``make()`` with the torch seed set to ``seed`` and its parameters created on ``device`` in
    ``dtype`` (:func:`constructing_on`), in eval mode: every builder's random weights."""
    torch.manual_seed(seed)
    with constructing_on(device, as_dtype(dtype)):
        module = make()
    return module.eval()


def init_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls.__init__``: diffusers' defaults are the released configs.

    Deep-copied because diffusers declares some defaults as shared mutable lists.
    """
    params = inspect.signature(cls.__init__).parameters
    return {
        k: copy.deepcopy(p.default)
        for k, p in params.items()
        if k != "self" and p.default is not inspect.Parameter.empty
    }
