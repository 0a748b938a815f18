"""How close an image made in a batch is to the same request made alone, on the tiny models
(CPU, eager, float32), through the server's engine (the call it builds, the PNG it writes).

Requests join only when their prompts pad to the same text length (the recipe's case: Z-Image's
multiple of 32, Qwen-Image's bucket), so no prompt is padded further for another's sake.

* The same batch size: bit for bit, whatever the other requests and their order, where the
  call's shapes are the same. Each image has its own generator, and kernels reduce in the same
  order for the same shapes. On the CPU, Qwen-Image's call pads a batch's prompts to its longest
  (its recipe's text buckets apply where graphs run), so a company whose longest prompt differs
  changes the attention's shapes: float noise, measured below.
* Another batch size: not bit for bit. CPU kernels choose their blocking, and so the order of
  their sums, by problem size, the batch included (MKL multiplies a single row by a
  matrix-vector path, other row counts by blocked GEMMs; oneDNN picks convolution algorithms by
  shape). The gap is below ``FLOAT_TOL`` in [0, 1] pixel floats and at most one level of the
  8-bit PNG; docs/serving.md has the numbers.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np
import pytest

from pipelines.generation import ModelSettings, Workload, load_pipeline
from pipelines.serve.engine import Engine
from pipelines.serve.schema import ImageRequest
from tests.pipelines.serve.server import decode

FLOAT_TOL = 1e-4  # measured up to 4e-6 (docs/serving.md): float32 noise, far from a changed image

Images = list[list[tuple[np.ndarray, np.ndarray]]]


class Recorder:
    """Keeps the float images of every call of the pipeline's class (the PNGs are 8-bit)."""

    def __init__(self, pipe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.floats: list[np.ndarray] = []
        call = type(pipe).__call__

        @functools.wraps(call)
        def recording(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            self.floats.extend(np.array(image) for image in out.images)
            return out

        monkeypatch.setattr(type(pipe), "__call__", recording)


def made(engine: Engine, recorder: Recorder, requests: list[ImageRequest]) -> Images:
    """Per request, per image: (float image, 8-bit pixels of the PNG), from one pipeline call."""
    recorder.floats.clear()
    out = engine.run([engine.plan(r) for r in requests])
    floats = iter(list(recorder.floats))
    return [[(next(floats), np.asarray(decode(g.b64_json))) for g in images] for images in out]


def gap(x: Images, y: Images) -> tuple[float, int]:
    """Largest float and 8-bit differences between the same requests' images."""
    floats = max(float(np.abs(a[0] - b[0]).max()) for rx, ry in zip(x, y) for a, b in zip(rx, ry))
    levels = max(int(np.abs(a[1].astype(int) - b[1].astype(int)).max()) for rx, ry in zip(x, y) for a, b in zip(rx, ry))
    return floats, levels


@pytest.mark.parametrize("model", ["z-image", "qwen-image"])
def test_a_batched_image_equals_the_request_alone(model: str, few_threads: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # The server's pipeline: built and accelerated as bcg-serve builds it.
    engine = Engine(load_pipeline(ModelSettings(model=model, device="cpu"), Workload(resolutions=[(64, 64)]),
                                  progress=False))  # fmt: skip
    recorder = Recorder(engine.pipe, monkeypatch)

    def req(prompt: str, n: int, seed: int) -> ImageRequest:
        return ImageRequest(prompt, n, 64, 64, seed=seed, steps=2)

    a, b, c = req("a red fox", 2, 10), req("a sailboat on a lake", 1, 3), req("a cat", 1, 7)
    c2, d = req("a dog", 1, 7), req("a small boat", 2, 99)  # c2: c's length; d: shorter than b
    plans = [engine.plan(r) for r in (a, b, c, c2, d)]
    assert len({p.key for p in plans}) == 1  # one text case: they may join
    assert engine.plan(req("a lighthouse in a storm, " * 12, 1, 0)).key != plans[0].key  # a longer one may not
    four = made(engine, recorder, [a, b, c])
    # The same company in another order, and another company of the same lengths: bit for bit.
    reordered = made(engine, recorder, [c, b, a])[::-1]
    assert gap(reordered, four) == (0.0, 0)
    swapped = made(engine, recorder, [a, b, c2])
    assert gap(swapped[:2], four[:2]) == (0.0, 0)
    # Another company whose longest prompt is shorter (same batch size 4).
    other = made(engine, recorder, [d, a])[1:]
    company = gap(other, four[:1])
    if model == "z-image":  # each caption is padded alone: the company does not reach a's shapes
        assert company == (0.0, 0)
    else:
        assert company[0] <= FLOAT_TOL and company[1] <= 1  # measured 8e-7: float noise
    # Alone (batch 2 for a, 1 for b and c): float noise, one 8-bit level at most.
    alone = [made(engine, recorder, [r])[0] for r in (a, b, c)]
    worst = gap(alone, four)
    sys.stderr.write(f"{model}: same batch size, other longest prompt: {company}; alone against a batch of 4: "
                     f"max |float diff| {worst[0]:.3g}, max 8-bit diff {worst[1]}\n")  # fmt: skip
    assert worst[0] <= FLOAT_TOL and worst[1] <= 1
