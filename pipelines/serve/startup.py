"""The engine's start: the model flags checked in the main thread before anything is built (and
before the server answers), then, on the device worker's thread, the pipeline built, its
adapters loaded, accelerated, and everything warmed up.

Both are the CLI's steps (:mod:`pipelines.cli.prepare`): the same checks, the same pipeline, the
adapters loaded by :func:`pipelines.lora.load_loras` before the accelerator. The server warms up
itself: every served size at every batch size a call may have, with and without guidance, for
every adapter state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from .config import ServeConfig
from .engine import Engine

__all__ = ["check", "starter"]

logger = logging.getLogger("bcg-serve")


def check(config: ServeConfig) -> tuple[Any, Any]:
    """The checks that need no model built (CLIError): device, dtype, a built-in model's limits
    at the served sizes. Returns the torch device and dtype."""
    from pipelines.cli.prepare import check_model, resolve_device_and_dtype

    device, dtype = resolve_device_and_dtype(config.settings)
    check_model(config.settings, device, dtype, config.resolutions)
    return device, dtype


def starter(config: ServeConfig, device: Any, dtype: Any) -> Callable[[], Engine]:
    """What the device worker runs first: returns the warm engine."""

    def start() -> Engine:
        from pipelines.cli import DEFAULT_PROMPT, Workload, prepare_pipeline

        settings = config.settings
        logger.info("building %s (%s) on %s", settings.model, settings.size, device)
        # The limits are checked for the largest call served; the server's own warm-up follows.
        workload = Workload(resolutions=config.resolutions, batch_size=config.max_batch, prompts=(DEFAULT_PROMPT,))
        prepared = prepare_pipeline(dataclasses.replace(settings, warmup=()), workload, device, dtype, progress=False)
        engine = Engine(prepared)
        sizes = config.resolutions if settings.warmup is None else settings.warmup
        if prepared.accelerated and sizes:
            engine.warmup(sizes, config.max_batch)
        return engine

    return start
