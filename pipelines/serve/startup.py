"""The engine's start: the model flags checked in the main thread before anything is built (and
before the server answers), then, on the device worker's thread, the pipeline built, its
adapters loaded, accelerated, and everything warmed up.

Both are the generation core's steps (:mod:`pipelines.generation.prepare`), as ``bcg-generate``'s: the same checks, the same pipeline, the
adapters loaded by :func:`pipelines.lora.load_loras` before the accelerator. The server warms up
itself (:mod:`.warmup`): every served size at every batch-size bucket, with and without guidance,
for every adapter state, after the memory admission (:mod:`.admission`) has checked that the
largest bucket fits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from pipelines.generation import GenerationError, InputError, ModelSettings

from .admission import Admission
from .config import ServeConfig
from .engine import Engine

__all__ = ["ServeSettings", "check", "starter"]

logger = logging.getLogger("bcg-serve")


def check(config: ServeConfig) -> tuple[Any, Any]:
    """The checks that need no model built (InputError): device, dtype, a built-in model's limits
    at the served sizes. Returns the torch device and dtype."""
    from pipelines.generation.prepare import check_model, resolve_device_and_dtype

    device, dtype = resolve_device_and_dtype(config.settings)
    check_model(config.settings, device, dtype, config.resolutions)
    if config.batching == "continuous":
        _check_steps(config.settings.model)
    return device, dtype


def _check_steps(model: str) -> None:
    """A built-in model whose pipeline has no loop by steps, refused before it is built (a folder
    or hub model is found out once built: :func:`_steps`)."""
    from pipelines.families.catalog import known_model
    from pipelines.stepwise.family import known_pipelines

    record = known_model(model)
    if record is not None and record.pipeline not in known_pipelines():
        raise InputError(f"--batching continuous: {record.pipeline}'s loop is not run a step at a time (known: "
                       f"{', '.join(known_pipelines())}); serve {record.name} with --batching dynamic")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ServeSettings(ModelSettings):
    """The model flags, and whether the accelerator captures a call it has no graph for
    (``--capture-on-miss``), which the model flags do not say."""

    capture_on_miss: bool = False

    def accelerate_options(self) -> dict[str, Any]:
        options = super().accelerate_options()
        if self.capture_on_miss:
            options["capture_on_miss"] = True
        return options


def admission_for(config: ServeConfig, prepared: Any) -> Admission:
    """The admission of ``prepared``'s pipeline: estimates from its components, the budget from
    ``--memory-budget`` or, on a CUDA device, what it has free now that the weights are loaded."""
    from pipelines import limits
    from pipelines.memory_estimate import estimate_activation_bytes

    pipe, device, call = prepared.pipe, prepared.device, prepared.call
    cfg = call.cfg or call.guidance is None  # the pipeline's own default may run CFG: plan as if it does

    @functools.cache
    def need(batch: int, size: tuple[int, int], graphs: bool) -> int:
        return estimate_activation_bytes(pipe, size[0], size[1], batch, cfg, graphs).total

    budget = config.memory_budget
    if budget is None and device.type == "cuda":
        budget = limits.available_memory(device)

    def held() -> int:
        accel = vars(pipe).get("accel")
        return accel.graph_memory_bytes() if accel is not None else 0

    return Admission(config.batch_sizes, need, budget, held, graphs=config.capture_on_miss)


def _image_inputs(engine: Engine, prepared: Any) -> None:
    """The pipelines ``/v1/images/edits`` goes to, accelerated as the model's own (their
    denoisers' graphs are the same): an edit model's own, or the image-to-image and inpainting
    pipelines diffusers makes from it, each where there is one; said in one line."""
    from pipelines.generation.image_input import image_pipeline, needs_image
    from pipelines.generation.prepare import accelerate_alike

    engine.needs_image = needs_image(type(prepared.pipe))
    said = []
    for masked in (False, True):
        try:
            taking = image_pipeline(prepared.pipe, mask=masked)
            if taking.pipe is not prepared.pipe:
                accelerate_alike(taking.pipe, prepared)
        except GenerationError as e:
            logger.info("edits%s: not served (%s)", " with a mask" if masked else "", e)
            continue
        engine.image_inputs[masked] = taking
        said.append(f"{type(taking.pipe).__name__} ({taking.kind}{', with a mask' if masked else ''})")
    if said:
        logger.info("edits (POST /v1/images/edits) through %s", " and ".join(said))


def _steps(pipe: Any) -> Any:
    """The pipeline's loop by steps (:mod:`pipelines.stepwise`), or InputError: why ``--batching
    continuous`` cannot serve it."""
    from pipelines.stepwise.family import StepError, steps_for

    try:
        return steps_for(pipe)
    except StepError as e:
        raise InputError(f"--batching continuous: {e}; serve it with --batching dynamic") from None


def starter(config: ServeConfig, device: Any, dtype: Any,
            setup: Callable[[Engine], None] | None = None) -> Callable[[], Engine]:  # fmt: skip
    """What the device worker runs first: returns the warm engine, its ``admission`` set and
    ``warm_sizes`` the sizes whose graphs the warm-up captured (None: every size is served).
    ``setup``: called with the engine before the warm-up (a Ray replica puts its adapter slots in)."""

    def start() -> Engine:
        from pipelines.generation import DEFAULT_PROMPT, Workload, prepare_pipeline

        from .warmup import warm_up

        fields = {f.name: getattr(config.settings, f.name) for f in dataclasses.fields(ModelSettings)}
        fields.update(warmup=(), capture_on_miss=config.capture_on_miss)  # the server's own warm-up follows
        settings = ServeSettings(**fields)
        logger.info("building %s (%s) on %s", settings.model, settings.size, device)
        # The core's limits are checked for one image at the largest size; the buckets are the
        # admission's to check, with the server's flags in its message.
        workload = Workload(resolutions=config.resolutions, batch_size=1, prompts=(DEFAULT_PROMPT,), edits=True)
        prepared = prepare_pipeline(settings, workload, device, dtype, progress=False)
        if prepared.call.video:  # a folder or hub model, known to make videos only now
            raise InputError(f"--model {settings.model}: {type(prepared.pipe).__name__} makes videos and bcg-serve "
                           "serves images (OpenAI's images API): use bcg-generate for videos")  # fmt: skip
        engine = Engine(prepared, config.batch_sizes)
        if config.batching == "continuous":
            engine.steps = _steps(prepared.pipe)
        _image_inputs(engine, prepared)
        if setup is not None:
            setup(engine)
        sizes = config.resolutions if config.settings.warmup is None else config.settings.warmup
        graphs = prepared.accelerated and settings.mode == "bcg" and bool(sizes)
        admission = admission_for(config, prepared)
        admission.check(list(sizes) if graphs else list(config.resolutions), graphs)
        engine.admission = admission
        if prepared.accelerated and sizes:
            warm = warm_up(engine, sizes, config.batch_sizes)
            engine.warmup_costs, engine.warmup_seconds = warm.costs, warm.seconds
            admission.measured(warm.peaks)
            if warm.captured:
                admission.warm = {(b, s) for b in config.batch_sizes for s in sizes}
                if not config.capture_on_miss:
                    engine.warm_sizes = tuple(s for s in config.resolutions if s in sizes)
        return engine

    return start
