"""What a run makes and where it goes, from the flags, before anything is built: its sizes
(``--resolution``, ``--width``/``--height``, an input image's), its image files' format
(``--format``, ``--out``'s suffix, ``--quality``) and the names of files that exist already."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .checks import free_names
from .constants import IMAGE_SUFFIXES, VIDEO_SUFFIXES, accel_options
from .errors import CLIError
from .formats import SUFFIXES
from .summary import shown

__all__ = ["ImageOutput", "Renames", "plan_image_output", "run_resolutions"]

logger = logging.getLogger("bcg-generate")

Size = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class ImageOutput:
    """How image files are written: ``fmt`` (png, jpeg, webp) at ``quality`` (None: the format's default)."""

    fmt: str = "png"
    quality: int | None = None

    @property
    def suffix(self) -> str:
        return SUFFIXES[self.fmt]


def plan_image_output(fmt: str | None, quality: int | None, single: Path | None, video: bool | None) -> ImageOutput:
    """The image files' format: a single ``--out`` file's suffix, else ``--format``, else PNG;
    CLIError where ``--format`` disagrees with that suffix or names a format for a video model's
    videos, or ``--quality`` is given for a lossless PNG."""
    suffix = single.suffix.lower() if single is not None else None
    if video and (suffix is None or suffix in VIDEO_SUFFIXES):
        for flag, value in (("--format", fmt), ("--quality", quality)):
            if value is not None:
                raise CLIError(f"{flag} {value} sets image files' format, and this model writes videos (.webp, .gif "
                               "or .mp4: --out names one)")  # fmt: skip
    named = IMAGE_SUFFIXES.get(suffix) if suffix is not None and not (video and suffix in VIDEO_SUFFIXES) else None
    if fmt is not None and named is not None and fmt != named:
        raise CLIError(f"--format {fmt} and --out {str(single)!r} ({named}) disagree: drop one")
    chosen = named or fmt or "png"
    if quality is not None and chosen == "png":
        raise CLIError("--quality sets JPEG's and lossy WebP's quality; PNG is lossless (--format jpeg or webp)")
    return ImageOutput(chosen, quality)


def run_resolutions(resolution: Sequence[Size] | None, width: int | None, height: int | None, default: Size,
                    image: Any = None) -> list[Size]:  # fmt: skip
    """The run's sizes: ``--resolution``'s, else ``--width`` and ``--height`` (the missing side
    the ``default``'s), else an input ``image``'s own rounded down to the resolution multiple
    (said in a log line), else ``default``. CLIError for ``--resolution`` with either side flag."""
    if resolution and (width or height):
        raise CLIError("--width/--height and --resolution both set the size: use one of them")
    if resolution:
        return list(dict.fromkeys(resolution))
    if width or height:
        return [(width or default[0], height or default[1])]
    if image is not None:
        multiple = accel_options().RESOLUTION_MULTIPLE
        w, h = (max(multiple, side // multiple * multiple) for side in image.size)
        if (w, h) != tuple(image.size):
            logger.info("size %dx%d: the input image's %dx%d, to a multiple of %d (--resolution sets another)", w,
                        h, *image.size, multiple)  # fmt: skip
        return [(w, h)]
    return [default]


class Renames:
    """Where this run's files that already exist go instead (without ``--overwrite``): the first
    free ``{stem}-N`` name, said once before anything is built, so a command can run again."""

    def __init__(self) -> None:
        self.moved: dict[str, Path] = {}

    def plan(self, folder: Path, single: Path | None, names: Iterable[str]) -> None:
        self.moved = free_names(folder, single, names)
        if not self.moved:
            return
        (old, new), more = next(iter(self.moved.items())), len(self.moved) - 1
        old_path = single if single is not None else folder / old
        also = f" (and {more} more of this run's files, each as its first free -N name)" if more else ""
        logger.warning("%s exists: kept; this run writes %s instead%s (--overwrite replaces it)", shown(old_path),
                       shown(new), also)  # fmt: skip

    def target(self, folder: Path, single: Path | None, name: str) -> Path:
        """The path of the file named ``name`` (``single``: the one file of ``--out``)."""
        if single is not None:
            return self.moved.get(single.name, single)
        return self.moved.get(name, folder / name)
