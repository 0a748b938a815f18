"""The pipeline side of the server: a request planned against the model's defaults, and a
batch of planned requests made into images by one pipeline call.

The model's knowledge is the generation core's (:mod:`pipelines.generation`), as ``bcg-generate``'s
is: a request's steps, guidance and negative prompt are resolved by
:func:`~pipelines.generation.call_settings`, the call's arguments by its
:class:`~pipelines.generation.CallSettings`, the call itself (errors in one line, non-finite pixels
refused) by :meth:`~pipelines.generation.PreparedPipeline.generate`, and each image's text by
:func:`~pipelines.generation.image_texts`, so a served image records what ``bcg-generate``'s
would. What the server adds: several requests in one call, each image with its own generator (diffusers takes a list), so an image's noise depends on
its own seed only, whichever requests share its call; and batch-size buckets: a call of k images
runs at the smallest bucket of at least k (``batch_sizes``), the rows added repeating the last
image (its prompt, negative prompt and seed, so its text length and batch key), then dropped. The
call's shapes are then the bucket's, which the warm-up captured: an image equals the same request
made in any other call of its bucket, bit for bit. A call that runs out of device memory is
:class:`~.admission.OutOfMemory` (the worker makes its images again in smaller calls). The images
a call makes are :class:`~.rendered.RenderedImage`, encoded later into the answer's files.

Only the device worker's thread calls :meth:`Engine.make` and :meth:`Engine.run`;
:meth:`Engine.plan` reads only what is fixed once the engine exists, so the routes call it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from pipelines.generation import CallSettings, Job, PreparedPipeline, RunError, StepWatch, call_settings, run_text
from pipelines.generation.calls import nan_hint
from pipelines.generation.image_input import EDIT, ImageInput, fitted, flatten, mask_from
from pipelines.generation.prompts import count_tokens
from pipelines.generation.record import image_texts, quantized, record_size_made
from pipelines.lora import LoraSpec, activate

from .admission import OutOfMemory
from .batcher import BatchKey
from .errors import ServeError
from .rendered import EncodedImage, RenderedImage
from .schema import MAX_SEED, ImageRequest

__all__ = ["Engine", "Plan", "TextCases", "bucket_for"]

logger = logging.getLogger("bcg-serve")

_EDITS = itertools.count(1)  # each edit request's number: its batch key is its own


def bucket_for(images: int, batch_sizes: Sequence[int] | None) -> int:
    """The smallest of ``batch_sizes`` of at least ``images`` (None: ``images`` itself)."""
    if not batch_sizes:
        return images
    for b in sorted(batch_sizes):
        if b >= images:
            return b
    raise ValueError(f"{images} images do not fit the largest batch size {max(batch_sizes)}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request with every default resolved (``call``) and its seeds: what it adds to a call.
    ``edit``: an edit's own number, so that no other request shares its call (each has its image)."""

    request: ImageRequest
    call: CallSettings
    seeds: tuple[int, ...]
    text: int | None = None
    negative_text: int | None = None
    edit: int | None = None

    @property
    def key(self) -> BatchKey:
        r, c = self.request, self.call
        return BatchKey(r.width, r.height, c.steps, c.guidance, c.negative_prompt is not None, r.lora, self.text,
                        self.negative_text, self.edit)  # fmt: skip


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


class Adapters:
    """The LoRA adapters the pipeline loaded (``--lora NAME=FILE[:SCALE]``), and which runs.

    :func:`pipelines.lora.load_loras` leaves them all active; a server runs one per call, by the
    request's name, or none (``disable_lora``: the base model, bit for bit). Requests with
    different adapters never share a call (the adapter is part of the batch key).
    """

    def __init__(self, pipe: Any, loaded: Sequence[LoraSpec]) -> None:
        self.pipe = pipe
        self._by_name = {spec.name: spec for spec in loaded}
        self.active: str | None = "" if loaded else None  # "": all, as loaded; forces the first select
        self.select(None)

    def names(self) -> list[str]:
        return [name for name in self._by_name if name is not None]

    def specs(self, name: str | None) -> list[LoraSpec]:
        return [] if name is None else [self._by_name[name]]

    def select(self, name: str | None) -> None:
        """Run adapter ``name`` alone (None: none) in the calls that follow."""
        if name != self.active:
            if name is None and self._by_name:
                # All active as loaded, then off: the same Python state whichever adapter ran last
                # (peft keeps its active adapters while disabled, and graphs are captured per state).
                activate(self.pipe, list(self._by_name.values()))
            activate(self.pipe, self.specs(name))
            self.active = name


class Engine:
    """A prepared pipeline (:func:`pipelines.generation.prepare_pipeline`) and what its calls need."""

    def __init__(self, prepared: PreparedPipeline, batch_sizes: Sequence[int] | None = None) -> None:
        self.prepared = prepared
        self.batch_sizes = tuple(sorted(set(batch_sizes))) if batch_sizes else None
        # Set by the start (:mod:`.startup`): the admission, the sizes served where graphs were
        # captured (None: every size), and what the warm-up cost per bucket.
        self.admission: Any = None
        self.warm_sizes: tuple[tuple[int, int], ...] | None = None
        self.warmup_costs: dict[int, Any] = {}
        self.warmup_seconds = 0.0
        self.pipe = prepared.pipe
        self.device = prepared.device
        self.adapters = Adapters(self.pipe, prepared.loras)
        self._text_cases = TextCases(self.pipe)
        self._scheduler_config = getattr(getattr(self.pipe, "scheduler", None), "config", None)
        # Set by the start: the pipelines that take an input image (:mod:`pipelines.generation.image_input`),
        # by whether a mask comes with it (absent: the model takes none so), and whether the model
        # makes images only from one (an edit model whose pipeline makes none from text alone).
        self.image_inputs: dict[bool, ImageInput] = {}
        self.needs_image = False
        # Set by the start with --batching continuous: the pipeline's loop by steps (:mod:`pipelines.stepwise`).
        self.steps: Any = None
        # Set by the start with --parallel, on rank 0: what sends each call to the other ranks
        # (:class:`pipelines.serve.ranks.Relay`).
        self.relay: Any = None

    def _taking(self, request: ImageRequest) -> ImageInput:
        """The pipeline that makes ``request``'s images from its input image; ServeError 400 where
        the model takes none (with a mask: where diffusers makes no inpainting pipeline of it)."""
        masked = request.mask is not None
        taking = self.image_inputs.get(masked)
        if taking is None:
            what = "input image with a mask" if masked else "input image"
            raise ServeError(400, f"{type(self.pipe).__name__} takes no {what}", param="mask" if masked else "image",
                             code="unsupported_edit")  # fmt: skip
        if request.strength is not None and not taking.strength:
            raise ServeError(400, f"strength: {type(taking.pipe).__name__} takes none (it redraws the whole image)",
                             param="strength", code="invalid_value")  # fmt: skip
        return taking

    @property
    def defaults(self) -> CallSettings:
        """How a request that names no steps, guidance or negative prompt is made."""
        return self.prepared.call

    # -- planning (any thread) -----------------------------------------------------------------

    def plan(self, request: ImageRequest) -> Plan:
        """Resolve ``request``'s defaults (a request without a seed gets a random one);
        :class:`ServeError` 400 where the model refuses a value."""
        from pipelines import limits

        p = self.prepared
        if request.image is None and self.needs_image:
            raise ServeError(400, f"{type(self.pipe).__name__} edits images: POST /v1/images/edits with the image",
                             param="image", code="image_required")  # fmt: skip
        taking = self._taking(request) if request.image is not None else None
        # What the call drops (its notes) is no news to a client: the image's record says what ran.
        call = call_settings(self.pipe if taking is None else taking.pipe, p.settings.model, p.settings.size,
                             request.steps, request.guidance, request.negative_prompt, p.call.frames)  # fmt: skip
        if taking is not None:
            strength = f", strength {request.strength:g}" if request.strength is not None else ""
            call = dataclasses.replace(call, image_note=f"{request.image_note}, {taking.kind}{strength}")
        if call.layered and request.output_format == "jpeg":
            raise ServeError(400, f"{type(taking.pipe if taking else self.pipe).__name__} makes each image as RGBA "
                             "layers, and jpeg has no alpha: ask png or webp", param="output_format",
                             code="unsupported_output_format")  # fmt: skip
        try:
            limits.check_steps(call.steps, self._scheduler_config)
        except limits.LimitError as e:
            raise ServeError(
                400, str(e).replace("--steps ", "steps ", 1), param="steps", code="invalid_value"
            ) from None
        first = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED - request.n + 2)
        w, h = request.width, request.height
        text = self._text_cases(request.prompt, w, h)
        negative = self._text_cases(call.negative_prompt, w, h) if call.negative_prompt is not None else None
        edit = next(_EDITS) if request.image is not None else None
        return Plan(request, call, tuple(range(first, first + request.n)), text, negative, edit)

    # -- the device (the worker's thread only) --------------------------------------------------

    def bucket(self, images: int) -> int:
        """The batch size a call of ``images`` images runs at."""
        return bucket_for(images, self.batch_sizes)

    def graph_memory_bytes(self) -> int:
        """Device memory the captured graphs hold now (0 where the pipeline is not accelerated)."""
        accel = vars(self.pipe).get("accel")
        return accel.graph_memory_bytes() if accel is not None else 0

    def denoiser_counts(self) -> tuple[int, int]:
        """(graph replays, eager calls) of the denoisers so far; zeros where nothing is counted.

        The denoisers only: ``accel.stats()`` also counts the components it captures (the text
        encoder, the VAE decoder), which run eagerly by design where they cannot be captured
        (Qwen-Image's VAE decoder) or where a prompt's token length was not warmed up (the
        text encoder's shapes are the prompt's own), and would count a replaying call as eager."""
        accel = vars(self.pipe).get("accel")
        if accel is None:
            return 0, 0
        stats = accel.stats(memory=False)  # counters only: read twice around every call
        counted = [stats[name] for name in accel.recipes if name in stats]
        return sum(s.replays for s in counted), sum(s.eager_calls for s in counted)

    def make(self, plans: Sequence[Plan], stop: Callable[[], bool] | None = None) -> list[list[RenderedImage]]:
        """One pipeline call for ``plans`` (one :class:`BatchKey`), at their bucket; per plan, its
        images, not yet encoded (the worker leaves that to the service's encoding threads).
        ``stop``: asked at the end of every denoising step; once true, the call ends there
        (:class:`~pipelines.generation.CallStopped`), where the pipeline takes a step callback.
        With ``--parallel`` every rank makes the call (:attr:`relay`)."""
        if self.relay is not None:
            return self.relay.lead(self, plans, stop)
        return self.make_here(plans, stop)

    @property
    def lost(self) -> str | None:
        """Why this engine can make no more calls (``--parallel``: a rank lost); None while it can."""
        return None if self.relay is None else self.relay.lost

    def close(self) -> None:
        """The device worker is done: with ``--parallel``, the other ranks told to exit."""
        if self.relay is not None:
            self.relay.close()

    def make_here(self, plans: Sequence[Plan], stop: Callable[[], bool] | None = None) -> list[list[RenderedImage]]:
        """:meth:`make` in this process alone (a ``--parallel`` rank's side of the call)."""
        import torch

        first, p = plans[0], self.prepared
        key, r = first.key, first.request
        assert all(q.key == key for q in plans), "a batch mixes keys"
        seeds = [s for q in plans for s in q.seeds]
        prompts = [q.request.prompt for q in plans for _ in q.seeds]
        negatives = [q.call.negative_prompt for q in plans for _ in q.seeds]
        pad = bucket_for(len(seeds), self.batch_sizes) - len(seeds)
        # Padded rows repeat the last image: same text length (the batch key's), so the call's
        # shapes are the bucket's, and its noise is a seed's like any other row's.
        seeds, prompts, negatives = (
            seeds + seeds[-1:] * pad,
            prompts + prompts[-1:] * pad,
            negatives + negatives[-1:] * pad,
        )
        job = Job(r.prompt, r.width, r.height, tuple(range(len(seeds))), tuple(seeds))
        pipe, arguments = None, {}  # over the model's own arguments: a generator per seed, its defaults
        if r.image is not None:  # an edit (alone in its call): one prompt and one image, its rows counted
            taking = self._taking(r)
            pipe = taking.pipe
            given = taking.kwargs(flatten(r.image, pipe), mask_from(r.mask) if r.mask is not None else None, r.strength)
            arguments = given if taking.kind == EDIT else fitted(given, (r.width, r.height))
        else:
            arguments = {"prompt": prompts, first.call.count_kwarg: 1}  # one prompt per image, a fresh list
            if first.call.negative_prompt is not None:
                arguments["negative_prompt"] = negatives
        self.adapters.select(key.lora)
        try:
            hint = nan_hint(p.settings.dtype, r.guidance, "guidance")
            watch = StepWatch(stop=stop) if stop is not None else None
            made = p.generate(job, hint, first.call, watch, pipe=pipe, arguments=arguments)
        except RunError as e:  # the core's out-of-memory line keeps the error it replaced as its context
            if isinstance(e.__context__, torch.OutOfMemoryError):
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # the failed call's blocks, for the smaller calls that follow
                raise OutOfMemory(len(seeds) - pad, len(seeds), (r.width, r.height)) from None
            raise
        images, ran = made.images, made.mode
        stacks = made.layers or [None] * len(images)
        out: list[list[RenderedImage]] = []
        start = 0
        for q in plans:
            n = len(q.seeds)
            out.append(self.made(q, images[start : start + n], ran, stacks[start : start + n]))
            start += n
        return out

    def made(self, plan: Plan, images: Sequence[Any], ran: str,
             layers: Sequence[Sequence[Any] | None] | None = None) -> list[RenderedImage]:  # fmt: skip
        """``plan``'s images (PIL, one per seed) with their PNG text, ``ran`` saying what the
        denoiser did (``bcg``: a graph replayed; else the mode); ``layers``: each image's layers,
        where a layered model made them."""
        p, r = self.prepared, plan.request
        job = Job(r.prompt, r.width, r.height, tuple(range(len(plan.seeds))), plan.seeds)
        common = run_text(p.settings.model, self.device, p.dtype, plan.call, p.cache, self.adapters.specs(r.lora),
                          quantized(self.pipe), p.scheduler_name)  # fmt: skip
        tokens = self._tokens(plan)
        texts = image_texts(job, common, ran, p.settings.mode, tokens)
        if images:  # a pipeline that picks its own size (Layered: from the input image) records it
            record_size_made(images[0], job, texts)
        fmt, compression = r.output_format, r.output_compression
        stacks = layers if layers is not None else [None] * len(images)
        return [
            RenderedImage(image, text, seed, tokens, fmt, compression, stack)
            for image, text, seed, stack in zip(images, texts, plan.seeds, stacks)
        ]

    def run(self, plans: Sequence[Plan]) -> list[list[EncodedImage]]:
        """:meth:`make` and every image encoded: one pipeline call and its files, per plan."""
        return [[f for m in made for f in m.files()] for made in self.make(plans)]

    def _tokens(self, plan: Plan) -> Any:
        try:
            return count_tokens(self.pipe, plan.request.prompt)
        except Exception:  # a tokenizer without a chat template, say: not counted, as bcg-generate does
            return None
