"""Checks that need no model: device, compile cache, the limits a built-in model's configs tell,
--frames by the model's name, and a local model's folder."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..families.catalog import known_model, video_model_names
from .errors import InputError, one_line

# Bytes per pixel of one decoded image on the host: the pipeline's float32 RGB array plus the
# 8-bit copy a PNG is made from. A floor no model can go below, checked before anything is built.
HOST_BYTES_PER_PIXEL = 3 * 4 + 3
# What a diffusers pipeline folder always holds (from_pretrained reads it first).
PIPELINE_INDEX = "model_index.json"


def resolve_device(text: str | None, mode: str | None) -> Any:
    """The torch device to run on; InputError for one that does not exist here."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"--device {text!r} is not a device torch knows (for example cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = f"--mode {mode} needs CUDA" if mode in ("bcg", "debug") else f"--device {text}"
            raise InputError(f"{why}, but no CUDA device is available here; pass --device cpu to run eagerly")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "meta":
        raise InputError("--device meta holds shapes but no data, so it cannot make images; use cpu or cuda")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
        available = getattr(backend, "is_available", None)
        if not callable(available) or not available():
            raise InputError(f"--device {text}: {device.type} is not available here (use cpu or cuda)")
    return device


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def can_create_in(folder: Path) -> str | None:
    """None if a file can be created in ``folder`` now, else why not.

    ``os.access`` answers for permission bits only: root passes it everywhere, and it says
    nothing of /proc, /sys or a file system mounted read-only. Creating (and at once removing) a
    hidden file is the one test that asks the file system itself.
    """
    probe = folder / f".bcg-generate-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e.strerror or one_line(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def check_compile_cache(path: Path, what: str = "--compile-cache") -> None:
    """InputError when the compile cache folder ``path`` (named by ``what``) cannot be used."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} {str(path)!r} is an existing file, not a folder")
    ancestor = nearest_existing(path)
    if not ancestor.is_dir() or can_create_in(ancestor) is not None:
        raise InputError(f"{what} {str(path)!r} cannot be created: {str(ancestor)!r} is not a writable folder")


def largest_first(sizes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The distinct ``sizes``, the most pixels first."""
    return sorted(set(sizes), key=lambda wh: (wh[0] * wh[1], wh), reverse=True)


def check_host_floor(largest: tuple[int, int], batch_size: int, frames: int | None = None) -> None:
    """Refuse a call whose decoded images (``frames`` of each video) alone exceed the host's free memory."""
    from .. import limits

    free = limits.host_available_memory()
    width, height = largest
    need = batch_size * (frames or 1) * width * height * HOST_BYTES_PER_PIXEL
    if free is not None and need > free:
        with_frames = f" and --frames {frames}" if frames else ""
        raise InputError(
            f"--resolution {width}x{height} with --batch-size {batch_size}{with_frames}: the decoded images of one "
            "call alone take "
            f"{limits.format_bytes(need)} of host memory ({HOST_BYTES_PER_PIXEL} bytes a pixel) but "
            f"{limits.format_bytes(free)} is free"
        )


def check_positions(limit: Any, resolutions: Iterable[tuple[int, int]], what: str) -> None:
    """InputError for a size beyond a :class:`pipelines.limits.PositionLimit`, in words that say which side.

    "8208x16 is larger than 8192x8192" reads as wrong: that image is only wider.
    """
    if limit is None:
        return
    for width, height in resolutions:
        wide, tall = width > limit.max_width, height > limit.max_height
        if wide and tall:
            beyond = f"is larger than {limit.max_width}x{limit.max_height}, the most"
        elif wide:
            beyond = f"is wider than {limit.max_width} pixels, the widest"
        elif tall:
            beyond = f"is taller than {limit.max_height} pixels, the tallest"
        else:
            continue
        raise InputError(f"{what} {width}x{height} {beyond} this model can place: {limit.reason}")


def check_frames(frames: int | None, pipeline: str, takes_frames: bool, temporal: int | None) -> None:
    """InputError for a ``--frames`` that ``pipeline`` cannot make.

    ``takes_frames``: its call has ``num_frames``; ``temporal``: its VAE's frames per latent frame.
    WanPipeline would round a count that is not ``temporal * k + 1`` with a warning; the run
    would then make other frames than asked, so the count is refused before anything runs.
    """
    if frames is None:
        return
    if not takes_frames:
        videos = ", ".join(video_model_names())
        raise InputError(
            f"--frames {frames}: {pipeline} makes images, not videos (--frames is for video models: {videos})"
        )
    if temporal and temporal > 1 and (frames - 1) % temporal:
        below = (frames - 1) // temporal * temporal + 1
        counts = ", ".join(str(temporal * k + 1) for k in range(5))
        raise InputError(
            f"--frames {frames}: {pipeline}'s VAE packs {temporal} frames into each latent frame after the first, "
            f"so a video has {temporal}k+1 frames: use {below} or {below + temporal} (valid: {counts}, ...)"
        )


def check_frames_by_name(model: str, frames: int | None) -> None:
    """``--frames`` against a built-in model, known by its name alone (no torch): InputError where
    it cannot make them. Another model's frames are checked once it is built."""
    known = known_model(model)
    if known is not None:
        check_frames(frames, known.pipeline, known.video, known.frames_per_latent)


def _looks_like_path(model: str) -> bool:
    # A hub id is exactly "org/name"; anything else with a separator, or starting like a path, is one.
    return model.startswith((".", "~", "/")) or model.count("/") > 1 or "\\" in model


def check_model_path(model: str) -> None:
    """InputError for a ``--model`` that names a path which is not a pipeline folder."""
    path = Path(model).expanduser()
    if path.is_file():
        raise InputError(
            f"--model {model!r} is a file; a local model is a diffusers pipeline folder ({PIPELINE_INDEX})"
        )
    if path.is_dir():
        if not (path / PIPELINE_INDEX).is_file():
            raise InputError(f"--model {model!r} is not a diffusers pipeline folder: it holds no {PIPELINE_INDEX}")
        return
    if _looks_like_path(model):
        raise InputError(f"--model {model!r}: no such folder")


def _check_embedded(model: str, size: str, device: Any, dtype: Any, resolutions: Sequence[tuple[int, int]],
                    warmup: Sequence[tuple[int, int]], frames: int | None = None) -> None:  # fmt: skip
    """Limits of the built-in models that their configs tell, before building anything."""
    from .. import limits
    from ..builders import SIZES, canonical_name

    name = canonical_name(model)
    if name is None:
        check_model_path(model)
        return
    if size not in SIZES:
        return
    check_frames_by_name(model, frames)
    limit = limits.embedded_position_limit(name, size)
    check_positions(limit, resolutions, "--resolution")
    check_positions(limit, warmup, "--warmup")
    if size == "full":
        # Full size exists to time real kernel sizes on a GPU; on a CPU even weights that fit
        # would take hours a step, so it is refused there whatever the memory.
        need = limits.embedded_weight_bytes(name, size, dtype)
        weights = f"{name}'s weights take {limits.format_bytes(need)} in {str(dtype).removeprefix('torch.')}"
        if device.type != "cuda":
            raise InputError(f"--size full needs a CUDA GPU ({weights}; this run is on {device}); "
                           "--size tiny runs anywhere")  # fmt: skip
        free = limits.available_memory(device)
        if free is not None and need > free:
            raise InputError(f"--size full: {weights} but {device} has {limits.format_bytes(free)} free")
