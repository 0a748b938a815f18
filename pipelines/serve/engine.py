"""The pipeline side of the server: a request planned against the model's defaults, and a
batch of planned requests made into images by one pipeline call.

Only the device worker's thread calls :meth:`Engine.run` and :meth:`Engine.warmup`;
:meth:`Engine.plan` reads only what is fixed once the engine exists, so the routes call it.
Each image has its own generator (diffusers takes a list), so an image's noise depends on its
own seed only, whichever requests share its call.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import inspect
import logging
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any

from .batcher import BatchKey
from .errors import ServeError
from .schema import MAX_SEED, ImageRequest

__all__ = ["Engine", "Generated", "Plan", "TextCases"]

logger = logging.getLogger("bcg-serve")


@dataclasses.dataclass(frozen=True)
class Generated:
    """One image as the response carries it: a base64 PNG and the seed it was made with."""

    b64_json: str
    seed: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request with every default resolved: what one request adds to a pipeline call."""

    request: ImageRequest
    steps: int
    guidance: float | None
    negative_prompt: str | None
    seeds: tuple[int, ...]

    text: int | None = None
    negative_text: int | None = None

    @property
    def key(self) -> BatchKey:
        r = self.request
        return BatchKey(r.width, r.height, self.steps, self.guidance, self.negative_prompt is not None, r.lora,
                        self.text, self.negative_text)  # fmt: skip


class TextCases:
    """The text length the denoiser's recipe pads a prompt to at a size (what a graph is
    captured for), measured with tokenizers of its own.

    A fast tokenizer's padding and truncation settings are state it changes per call; two
    threads sharing one (the routes planning, the worker generating) can fail with "Already
    borrowed". So the routes' thread measures with copies. None where the recipe cannot measure.
    """

    def __init__(self, pipe: Any) -> None:
        recipes = getattr(getattr(pipe, "accel", None), "recipes", None) or {}
        self._recipe = next(iter(recipes.values()), None)
        self._view = _OwnTokenizers(pipe)

    def __call__(self, prompt: str, width: int, height: int) -> int | None:
        if self._recipe is None:
            return None
        try:
            (length,) = self._recipe.prompt_lengths(self._view, [prompt])
        except NotImplementedError:
            return None
        return self._recipe.warmup_length(length, width, height)


class _OwnTokenizers:
    """``pipe`` with copies of its tokenizers in their places; everything else is the pipe's."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
            tokenizer = getattr(pipe, name, None)
            if tokenizer is not None:
                setattr(self, name, copy.deepcopy(tokenizer))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class Engine:
    """A built, accelerated pipeline and what its calls need.

    ``png`` turns one output image and its text metadata into PNG bytes; ``meta`` is the text
    every image of this server records (model, device, dtype, cache, software).
    """

    def __init__(self, pipe: Any, device: Any, meta: dict[str, str], png: Any, frames: int | None = None) -> None:
        from pipelines.cli import generation_defaults

        self.pipe = pipe
        self.device = device
        self.meta = dict(meta)
        self.frames = frames
        self._png = png
        self.defaults = generation_defaults(pipe)
        params = inspect.signature(pipe.__call__).parameters
        self._per_prompt = "num_images_per_prompt"
        if self._per_prompt not in params and "num_videos_per_prompt" in params:
            self._per_prompt = "num_videos_per_prompt"
        self._output_type = "output_type" in params
        self._scheduler_config = getattr(getattr(pipe, "scheduler", None), "config", None)
        self._text_cases = TextCases(pipe)
        self._active_lora: str | None = None

    # -- planning (any thread) -----------------------------------------------------------------

    def plan(self, request: ImageRequest) -> Plan:
        """Resolve ``request``'s defaults; :class:`ServeError` 422 where the model refuses a value."""
        from pipelines import limits

        d = self.defaults
        steps = request.steps or d.steps
        try:
            limits.check_steps(steps, self._scheduler_config)
        except limits.LimitError as e:
            raise ServeError(422, f"steps: {e}", param="steps", code="invalid_value") from None
        guidance = request.guidance if request.guidance is not None else d.guidance
        if d.guidance_kwarg is None:
            guidance = None  # the pipeline takes no scale: it must not split batches either
        cfg = guidance is not None and guidance > d.cfg_above
        # As the CLI: a negative prompt counts only where classifier-free guidance runs.
        negative = request.negative_prompt if cfg else None
        if cfg and negative is None:
            negative = d.default_negative
        seed = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED - request.n + 2)
        w, h = request.width, request.height
        text = self._text_cases(request.prompt, w, h)
        negative_text = self._text_cases(negative, w, h) if negative is not None else None
        return Plan(request, steps, guidance, negative, tuple(range(seed, seed + request.n)), text, negative_text)

    # -- the device (the worker's thread only) --------------------------------------------------

    def denoiser_counts(self) -> tuple[int, int]:
        """(graph replays, eager calls) of the denoisers so far; zeros where nothing is counted."""
        try:
            stats = self.pipe.accel.stats().values()
        except AttributeError:
            return 0, 0
        return sum(s.replays for s in stats), sum(s.eager_calls for s in stats)

    def run(self, plans: Sequence[Plan]) -> list[list[Generated]]:
        """One pipeline call for ``plans`` (one :class:`BatchKey`); per plan, its images."""
        import torch

        first = plans[0]
        key, r = first.key, first.request
        assert all(p.key == key for p in plans), "a batch mixes keys"
        prompts = [p.request.prompt for p in plans for _ in p.seeds]  # a fresh list: pipelines edit it
        kwargs: dict[str, Any] = dict(
            prompt=prompts,
            height=r.height,
            width=r.width,
            num_inference_steps=first.steps,
            generator=[torch.Generator(self.device).manual_seed(s) for p in plans for s in p.seeds],
        )
        kwargs[self._per_prompt] = 1
        if self.frames is not None:
            kwargs["num_frames"] = self.frames
        if self._output_type:
            kwargs["output_type"] = "np"  # floats: NaN pixels are told from black ones
        if key.negative:
            kwargs["negative_prompt"] = [p.negative_prompt for p in plans for _ in p.seeds]
        if first.guidance is not None and self.defaults.guidance_kwarg is not None:
            kwargs[self.defaults.guidance_kwarg] = first.guidance
        self._select_lora(key.lora)
        before = self.denoiser_counts()[0]
        images = _images(self.pipe(**kwargs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ran = "bcg" if self.denoiser_counts()[0] > before else "eager"
        out: list[list[Generated]] = []
        i = 0
        for p in plans:
            mine = []
            for index, seed in enumerate(p.seeds):
                info = self._info(p, index, seed, ran)
                mine.append(Generated(base64.b64encode(self._png(images[i], info)).decode("ascii"), seed))
                i += 1
            out.append(mine)
        return out

    def _info(self, p: Plan, index: int, seed: int, ran: str) -> dict[str, str]:
        r = p.request
        info = dict(prompt=r.prompt, seed=str(seed), resolution=f"{r.width}x{r.height}", index=str(index), mode=ran)
        if ran != "bcg":
            info["requested_mode"] = "bcg"
        info.update(
            negative_prompt=p.negative_prompt or "",
            steps=str(p.steps),
            guidance="default" if p.guidance is None else f"{p.guidance:g}",
        )
        if r.lora is not None:
            info["lora"] = r.lora
        info.update(self.meta)
        return info

    def _select_lora(self, name: str | None) -> None:
        if name == self._active_lora:
            return
        if name is None:
            self.pipe.disable_lora()
        else:
            if self._active_lora is None:
                self.pipe.enable_lora()
            self.pipe.set_adapters([name])
        self._active_lora = name

    def warmup(self, sizes: Sequence[tuple[int, int]], batch_sizes: Sequence[int], cfg: Sequence[bool]) -> float:
        """Capture every size at every batch size, largest first, one log line per size; seconds."""
        ordered = sorted(dict.fromkeys(sizes), key=lambda wh: (wh[0] * wh[1], wh), reverse=True)
        total = 0.0
        for i, (w, h) in enumerate(ordered, 1):
            t0 = time.perf_counter()
            report = self.pipe.accel.warmup([(w, h)], batch_sizes=list(batch_sizes), cfg=list(cfg), progress=False)
            seconds = time.perf_counter() - t0
            total += seconds
            what = report.skipped or f"{report.total_captures} graph(s), {report.total_resident_bytes / 2**20:.1f} MiB"
            logger.info("warm-up %d/%d: %dx%d, batch sizes %s: %.2f s (%s)", i, len(ordered), w, h,
                        ",".join(map(str, batch_sizes)), seconds, what)  # fmt: skip
        return total


def _images(output: Any) -> list[Any]:
    """A pipeline output -> one float HxWxC array per image (a video's first frame); a NaN or
    infinite pixel anywhere is an error, never an image."""
    import numpy as np

    video = getattr(output, "images", None) is None and getattr(output, "frames", None) is not None
    array = np.asarray(output.frames if video else output.images)
    if not np.isfinite(array).all():
        raise FloatingPointError("the pipeline produced NaN or infinite pixels")
    return list(array[:, 0] if video else array)


def _cfg_cases(defaults: Any) -> list[bool]:
    """Guidance settings requests may take: both where the model runs classifier-free guidance."""
    if defaults.guidance_kwarg is None or math.isinf(defaults.cfg_above):
        return [False]
    return [True, False]
