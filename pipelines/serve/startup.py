"""The engine's start, on the device worker's thread: build, accelerate, warm up."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

from .config import ServeConfig
from .engine import Engine, _cfg_cases

__all__ = ["starter"]

logger = logging.getLogger("bcg-serve")


def _png(image: Any, info: dict[str, str]) -> bytes:
    from diffusers.image_processor import VaeImageProcessor
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for k, v in info.items():
        meta.add_text(k, v)
    buf = io.BytesIO()
    VaeImageProcessor.numpy_to_pil(image[None])[0].save(buf, format="PNG", pnginfo=meta)
    return buf.getvalue()


def starter(config: ServeConfig) -> Callable[[], Engine]:
    def start() -> Engine:
        import torch

        from accel import accelerate_pipeline
        from pipelines.cli import build_model

        a = config.args
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        logger.info("building %s (%s) on %s", a.model, a.size, device)
        pipe = build_model(a.model, a.size, device, dtype)
        pipe.set_progress_bar_config(disable=True)
        accelerate_pipeline(pipe)
        from pipelines.cli.arguments import package_version

        meta = dict(
            model=a.model,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            Software=f"bcg-diffusers {package_version()}",
        )
        engine = Engine(pipe, device, meta, _png)
        engine.warmup(config.resolutions, range(1, config.max_batch + 1), _cfg_cases(engine.defaults))
        return engine

    return start
