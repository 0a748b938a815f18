"""Model-like code for tests/graphs/test_discover.py: host syncs in module-level functions and methods.

:func:`raising_op` stands in for a torch operator that CUDA refuses during capture. Its code is
compiled with a ``torch.*`` module name, so its frame counts as torch's own (as a C++ operator
has no Python frame at all) and :func:`accel.graphs.discover.locate` looks past it to the model code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"

_TORCH_SIDE = """
def raising_op(original, when, message):
    def op(self, *args, **kwargs):
        if when():
            raise RuntimeError(message)
        return original(self, *args, **kwargs)
    return op
"""
_namespace: dict[str, Any] = {"__name__": "torch._simulated_capture"}
exec(compile(_TORCH_SIDE, "<simulated torch operator>", "exec"), _namespace)
raising_op: Callable[[Any, Callable[[], bool], str], Callable[..., Any]] = _namespace["raising_op"]


def positive_gate(x: torch.Tensor) -> torch.Tensor:
    if (x > 0).all():
        return x * 2
    return -x


def model_step(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    return positive_gate(y) * 3


def positive_rows(x: torch.Tensor) -> Iterator[torch.Tensor]:
    for row in x:
        if (row > 0).all():
            yield row


def make_closure() -> Callable[[torch.Tensor], torch.Tensor]:
    def inner(x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():
            return x
        return -x

    return inner


def current_frame() -> FrameType:
    return sys._getframe()


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().max().item()
        return x / (peak + 1.0)

    @staticmethod
    def normalise(x: torch.Tensor) -> torch.Tensor:
        return x / (x.abs().sum().item() + 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.scale(self.lin(x)))
