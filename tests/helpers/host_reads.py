"""Host reads of tensors inside a module's calls: on a GPU each one makes the host wait for the
device to finish what it was given, so a replayed step that reads one leaves the GPU idle while
the host launches the next work.

Under the emulator every tensor lives on the CPU, so no read waits here; :func:`count_host_reads`
counts them instead, by the methods that read a tensor's values on the host (``item``,
``tolist``, ``cpu``, ``numpy``, and the conversions ``bool``, ``int``, ``float`` and ``index``
use), while ``module`` is being called. Each count is keyed by the method and the line that
called it.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Iterator

import pytest
import torch

__all__ = ["count_host_reads"]

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads(module: torch.nn.Module) -> Iterator[collections.Counter]:
    """Inside, the host reads made during ``module``'s calls, counted by (method, file, line)."""
    reads: collections.Counter = collections.Counter()
    inside = [0]
    call = type(module).__call__

    def counted_call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self is not module:
            return call(self, *args, **kwargs)
        inside[0] += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(module), "__call__", counted_call)
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def read(self, *args, _original=original, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                if inside[0]:
                    caller = traceback.extract_stack(limit=2)[0]
                    reads[(_name, caller.filename.rsplit("site-packages/", 1)[-1], caller.lineno)] += 1
                return _original(self, *args, **kwargs)

            mp.setattr(torch.Tensor, name, read)
        yield reads
