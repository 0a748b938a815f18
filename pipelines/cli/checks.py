"""Checks that need no model: prompts file, device, --out, compile cache, limits told by configs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import limits
from .errors import CLIError, _one_line

# Bytes per pixel of one decoded image on the host: the pipeline's float32 RGB array plus the
# 8-bit copy a PNG is made from. A floor no model can go below, checked before anything is built.
HOST_BYTES_PER_PIXEL = 3 * 4 + 3
# Suffixes Pillow does not register but users type for images: --out with one is a mistake.
_MORE_IMAGE_SUFFIXES = (".avif", ".heic", ".heif", ".jxl", ".jpe", ".jfif")


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a file: one a line, blank lines and ``#`` comments skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not part of a prompt
    except FileNotFoundError:
        raise CLIError(f"--prompts-file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise CLIError(f"--prompts-file {str(path)!r} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompts-file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CLIError(f"cannot read --prompts-file {str(path)!r}: {e.strerror or _one_line(e)}") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise CLIError(f"--prompts-file {str(path)!r} holds no prompts (blank lines and # comments are skipped)")
    return prompts


def resolve_device(text: str | None, mode: str | None) -> Any:
    """The torch device to run on; CLIError for one that does not exist here."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise CLIError(f"--device {text!r} is not a device torch knows (for example cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = f"--mode {mode} needs CUDA" if mode in ("bcg", "debug") else f"--device {text}"
            raise CLIError(f"{why}, but no CUDA device is available here; pass --device cpu to run eagerly")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "meta":
        raise CLIError("--device meta holds shapes but no data, so it cannot make images; use cpu or cuda")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
        available = getattr(backend, "is_available", None)
        if not callable(available) or not available():
            raise CLIError(f"--device {text}: {device.type} is not available here (use cpu or cuda)")
    return device


def _image_suffixes() -> set[str]:
    from PIL import Image

    return {s.lower() for s in Image.registered_extensions()} | set(_MORE_IMAGE_SUFFIXES)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_out(out: Path, n_images: int) -> tuple[Path, Path | None]:
    """The folder to write into and the single file, if one; nothing is created here.

    The folder is made only when the first image is written, so a run refused later leaves no
    empty folder behind.
    """
    suffix = out.suffix.lower()
    single = suffix == ".png" and not out.is_dir()
    if not single and suffix in _image_suffixes() and not out.is_dir():
        raise CLIError(f"--out {str(out)!r}: only PNG is written; use {str(out.with_suffix('.png'))!r} (or a folder)")
    if single and n_images != 1:
        raise CLIError(f"--out {str(out)!r} names one file but this run makes {n_images} images; pass a folder")
    folder = out.parent if single else out
    if folder.exists() and not folder.is_dir():
        raise CLIError(f"--out {str(folder)!r} is an existing file, not a folder")
    ancestor = _nearest_existing(folder)
    if not ancestor.is_dir():
        raise CLIError(f"--out {str(out)!r} is not writable: {str(ancestor)!r} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"--out {str(out)!r} is not writable: no permission to write in {str(ancestor)!r}")
    return folder, out if single else None


def _check_compile_cache(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CLIError(f"--compile-cache {str(path)!r} is an existing file, not a folder")
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"--compile-cache {str(path)!r} cannot be created: {str(ancestor)!r} is not a writable folder")


def _check_host_floor(largest: tuple[int, int], batch_size: int) -> None:
    """Refuse a call whose decoded images alone exceed the host's free memory (any model)."""
    free = limits.host_available_memory()
    width, height = largest
    need = batch_size * width * height * HOST_BYTES_PER_PIXEL
    if free is not None and need > free:
        raise CLIError(
            f"--resolution {width}x{height} with --batch-size {batch_size}: the decoded images of one call alone take "
            f"{limits.format_bytes(need)} of host memory ({HOST_BYTES_PER_PIXEL} bytes a pixel) but "
            f"{limits.format_bytes(free)} is free"
        )


def _looks_like_path(model: str) -> bool:
    # A hub id is exactly "org/name"; anything else with a separator, or starting like a path, is one.
    return model.startswith((".", "~", "/")) or model.count("/") > 1 or "\\" in model


def _check_embedded(model: str, size: str, device: Any, dtype: Any, resolutions: Sequence[tuple[int, int]],
                    warmup: Sequence[tuple[int, int]]) -> None:  # fmt: skip
    """Limits of the built-in models that their configs tell, before building anything."""
    from ..builders import SIZES, canonical_name

    name = canonical_name(model)
    if name is None:
        if _looks_like_path(model) and not os.path.isdir(model):
            raise CLIError(f"--model {model!r}: no such folder")
        return
    if size not in SIZES:
        return
    try:
        limit = limits.embedded_position_limit(name, size)
        limits.check_positions(limit, resolutions, "--resolution")
        limits.check_positions(limit, warmup, "--warmup")
    except limits.LimitError as e:
        raise CLIError(str(e)) from None
    if size == "full":
        # Full size exists to time real kernel sizes on a GPU; on a CPU even weights that fit
        # would take hours a step, so it is refused there whatever the memory.
        need = limits.embedded_weight_bytes(name, size, dtype)
        weights = f"{name}'s weights take {limits.format_bytes(need)} in {str(dtype).removeprefix('torch.')}"
        if device.type != "cuda":
            raise CLIError(f"--size full needs a CUDA GPU ({weights}; this run is on {device}); "
                           "--size tiny runs anywhere")  # fmt: skip
        free = limits.available_memory(device)
        if free is not None and need > free:
            raise CLIError(f"--size full: {weights} but {device} has {limits.format_bytes(free)} free")
