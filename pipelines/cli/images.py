"""One pipeline call to images, and an image to a PNG file that appears only once complete."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import RunError, _one_line
from .jobs import Job


def _generate(pipe: Any, kwargs: dict[str, Any], job: Job, hint: str, cache: str | None = None) -> list[Any]:
    """One pipeline call -> PIL images; RunError for out-of-memory or non-finite pixels.

    A video pipeline's output (``frames``, not ``images``) gives the first frame of each video;
    every frame is checked for non-finite pixels, since a NaN anywhere says the call went wrong.
    ``cache``: the step cache applied (its description), if any: a cache hook that fails inside
    the call is told in one line with the cache named, since it, not the pipeline, is the suspect.
    """
    import numpy as np
    import torch

    from accel import ParallelError

    try:
        output = pipe(**kwargs)
    except ParallelError as e:  # --parallel: the ranks disagree or lost one another
        raise RunError(_one_line(e)) from None
    except torch.OutOfMemoryError:
        raise RunError(
            f"out of memory generating {len(job.indices)} image(s) at {job.width}x{job.height}: "
            "use a smaller --resolution or --batch-size"
        ) from None
    except Exception as e:
        if cache is not None:
            raise RunError(f"{type(pipe).__name__} failed with --cache {cache}: {type(e).__name__}: "
                           f"{_one_line(e)[:300]} (try without --cache)") from None  # fmt: skip
        if isinstance(e, (TypeError, ValueError)):  # a pipeline that needs more than a prompt (an input image...)
            raise RunError(f"{type(pipe).__name__} refused the call: {_one_line(e)[:300]}") from None
        raise
    video = getattr(output, "images", None) is None and getattr(output, "frames", None) is not None
    pixels = output.frames if video else output.images
    if kwargs.get("output_type") != "np":
        return [frames[0] for frames in pixels] if video else list(pixels)
    array = np.asarray(pixels)
    if not np.isfinite(array).all():
        raise RunError(
            f"the pipeline produced NaN or infinite pixels for {job.width}x{job.height} seed {job.seeds[0]}"
            f"{hint}; nothing was written for this call"
        )
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(array[:, 0] if video else array)


@contextlib.contextmanager
def _removed_on_failure(path: Path) -> Iterator[Path]:
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


# errnos of file systems without hard links (FAT, some network mounts): os.link cannot be the
# no-clobber rename there.
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.ENOSYS, errno.EMLINK}


def _candidates(path: Path) -> Iterator[Path]:
    yield path
    for n in itertools.count(1):
        yield path.with_name(f"{path.stem}-{n}{path.suffix}")


def _claim(part: Path, path: Path) -> Path:
    """Give the complete file ``part`` the name ``path``, or the first free ``{stem}-N.png``.

    ``os.link`` fails if the name exists, atomically, so two runs writing into one folder never
    replace each other's images (``os.replace`` would, silently). Where hard links are not
    supported the name is reserved with ``O_EXCL`` and then replaced: as safe, but an empty file
    is visible for a moment.
    """
    for candidate in _candidates(path):
        try:
            os.link(part, candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        os.replace(part, candidate)
        return candidate
    raise AssertionError("unreachable")  # itertools.count never ends


def save_png(image: Any, path: Path, info: dict[str, str], overwrite: bool = False) -> Path:
    """Write ``image`` with ``info`` as PNG text chunks; returns the path written.

    The file appears only once complete: it is written under a hidden name of its own (unique,
    so concurrent runs never share one) and then renamed. An existing file is replaced only
    with ``overwrite``; otherwise one that appeared since the run checked (another run writing
    the same name) is kept, and the image takes the first free name ``{stem}-N.png`` instead.
    """
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in info.items():
        meta.add_text(key, value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        # Created here, exclusively and with the umask's permissions; Pillow then writes into it.
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        with _removed_on_failure(part):
            image.save(part, format="PNG", pnginfo=meta)
            if overwrite:
                os.replace(part, path)
                return path
            written = _claim(part, path)
            with contextlib.suppress(FileNotFoundError):  # gone already where the name was taken by a rename
                part.unlink()
        return written
    except OSError as e:
        raise RunError(f"cannot write {str(path)!r}: {e.strerror or _one_line(e)}") from None
