"""One pipeline call to images, and an image to a PNG file that appears only once complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import RunError, _one_line
from .jobs import Job


def _generate(pipe: Any, kwargs: dict[str, Any], job: Job, hint: str) -> list[Any]:
    """One pipeline call -> PIL images; RunError for out-of-memory or non-finite pixels."""
    import numpy as np
    import torch

    from accel.parallel import ParallelError

    try:
        images = pipe(**kwargs).images
    except ParallelError as e:  # --parallel: the ranks disagree or lost one another
        raise RunError(_one_line(e)) from None
    except (TypeError, ValueError) as e:  # a pipeline that needs more than a prompt (an input image...)
        raise RunError(f"{type(pipe).__name__} refused the call: {_one_line(e)[:300]}") from None
    except torch.OutOfMemoryError:
        raise RunError(
            f"out of memory generating {len(job.indices)} image(s) at {job.width}x{job.height}: "
            "use a smaller --resolution or --batch-size"
        ) from None
    if kwargs.get("output_type") != "np":
        return list(images)
    array = np.asarray(images)
    if not np.isfinite(array).all():
        raise RunError(
            f"the pipeline produced NaN or infinite pixels for {job.width}x{job.height} seed {job.seeds[0]}"
            f"{hint}; nothing was written for this call"
        )
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(array)


@contextlib.contextmanager
def _removed_on_failure(path: Path) -> Iterator[Path]:
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _save_png(image: Any, path: Path, info: dict[str, str]) -> None:
    """Write ``image`` with ``info`` as PNG text chunks; the file appears only once complete."""
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in info.items():
        meta.add_text(key, value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _removed_on_failure(path.with_name(f".{path.name}.part")) as part:
            image.save(part, format="PNG", pnginfo=meta)
            os.replace(part, path)
    except OSError as e:
        raise RunError(f"cannot write {str(path)!r}: {e.strerror or _one_line(e)}") from None
