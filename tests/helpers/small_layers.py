"""Qwen-Image Layered at a size a CPU decodes in a moment: its size rule scaled down.

The pipeline makes its layers at 640 or 1024 pixels a side (``calculate_dimensions`` of
``resolution**2`` and the input image's aspect), minutes of even a tiny VAE on a CPU.
:func:`shrink_layers` divides that area by :data:`SHRINK` (80x64 for a 640 resolution at 4:3) for
every caller in the process, the stock pipeline and the accelerated one alike, which changes no
code path. ``python -m tests.helpers.small_layers [bcg-serve flags]`` is ``bcg-serve`` so shrunk,
its graphs emulated as on a GPU (:func:`tests.helpers.after_warmup.as_on_cuda`).
"""

from __future__ import annotations

import sys

import pytest
from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as layered_pipeline

__all__ = ["SHRINK", "shrink_layers"]

SHRINK = 64
_REAL = layered_pipeline.calculate_dimensions


def shrink_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layered's layers at ``1/SHRINK`` of the area its release makes them at, until ``monkeypatch`` undoes it."""
    monkeypatch.setattr(layered_pipeline, "calculate_dimensions", lambda area, ratio: _REAL(area / SHRINK, ratio))


if __name__ == "__main__":
    import torch

    from pipelines.serve import main
    from tests.helpers.after_warmup import as_on_cuda

    torch.set_num_threads(1)  # tiny models: a second thread only fights the others over the cores
    patches = pytest.MonkeyPatch()  # undone only when the process ends
    shrink_layers(patches)
    as_on_cuda(patches)
    sys.exit(main())
