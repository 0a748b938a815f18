"""What a run makes and where it goes, from the flags, before anything is built: its sizes
(``--resolution``, ``--width``/``--height``, an input image's), ``--out`` checked, its image
files' format (``--format``, ``--out``'s suffix, ``--quality``) and the names of files that exist
already."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..generation.checks import can_create_in, nearest_existing
from ..generation.constants import accel_options
from ..generation.errors import InputError
from ..generation.formats import IMAGE_SUFFIXES, SUFFIXES
from .summary import shown
from .video import VIDEO_SUFFIXES

__all__ = ["ImageOutput", "Renames", "check_out", "free_names", "plan_image_output", "run_resolutions"]

logger = logging.getLogger("bcg-generate")

Size = tuple[int, int]
# Suffixes Pillow does not register but users type for images: --out with one is a mistake.
_MORE_IMAGE_SUFFIXES = (".avif", ".heic", ".heif", ".jxl", ".jpe", ".jfif")


def _image_suffixes() -> set[str]:
    from PIL import Image

    return {s.lower() for s in Image.registered_extensions()} | set(_MORE_IMAGE_SUFFIXES)


def check_out(out: Path, n_images: int, video: bool | None = False) -> tuple[Path, Path | None]:
    """The folder to write into and the single file, if one; nothing is left behind here.

    ``video``: the model makes videos (None: not known before it is built), whose files may
    also be ``.webp``, ``.gif`` or ``.mp4`` (:mod:`pipelines.cli.video`). The folder is made only
    when the first file is written, so a run refused later leaves no empty folder behind.
    """
    suffix = out.suffix.lower()
    images = tuple(IMAGE_SUFFIXES)
    containers = (*images, *VIDEO_SUFFIXES) if video is not False else images
    single = suffix in containers and not out.is_dir()
    if not single and suffix in _image_suffixes() and not out.is_dir():
        if video is not False:
            raise InputError(f"--out {str(out)!r}: a video is written as .webp, .gif or .mp4 (or its first frame as "
                           f".png or .jpg); use {str(out.with_suffix('.webp'))!r} (or a folder)")  # fmt: skip
        if suffix in VIDEO_SUFFIXES:
            raise InputError(f"--out {str(out)!r}: images are written as PNG, JPEG or WebP ({suffix} is for a video "
                           f"model's frames); use {str(out.with_suffix('.png'))!r} (or a folder)")  # fmt: skip
        raise InputError(f"--out {str(out)!r}: images are written as PNG, JPEG or WebP; use "
                       f"{str(out.with_suffix('.png'))!r} (or a folder)")  # fmt: skip
    if single and n_images != 1:
        what = "videos" if video else "images"
        raise InputError(f"--out {str(out)!r} names one file but this run makes {n_images} {what}; pass a folder")
    folder = out.parent if single else out
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {str(folder)!r} is an existing file, not a folder")
    ancestor = nearest_existing(folder)
    if not ancestor.is_dir():
        raise InputError(f"--out {str(out)!r} is not writable: {str(ancestor)!r} is a file, not a folder")
    why = can_create_in(ancestor)
    if why is not None:
        raise InputError(f"--out {str(out)!r} is not writable: cannot create files in {str(ancestor)!r} ({why})")
    return folder, out if single else None


def free_names(folder: Path, single: Path | None, names: Iterable[str]) -> dict[str, Path]:
    """Where each of this run's files that already exists goes instead (asked without --overwrite):
    the first ``{stem}-N{suffix}`` that neither exists nor is another of the run's names, by name
    (``single``: the one file of ``--out x.png``; else the files ``names`` in ``folder``).

    The folder is listed once rather than each name looked up: a prompts file of a million lines
    would otherwise cost a million file-system calls before anything starts.
    """
    if single is not None:
        if not os.path.lexists(single):
            return {}
        present, wanted, folder = set(os.listdir(single.parent or ".")), [single.name], single.parent
    else:
        try:
            present = set(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError):
            present = set()
        # ``names`` is consumed only if the folder holds anything: a new folder costs nothing.
        wanted = list(names) if present else []
    taken = present | set(wanted)
    moved: dict[str, Path] = {}
    for name in wanted:
        if name in present:
            free = next(c for c in _candidates(Path(name)) if c.name not in taken)
            taken.add(free.name)
            moved[name] = folder / free.name
    return moved


def _candidates(path: Path) -> Iterable[Path]:
    for n in itertools.count(1):
        yield path.with_name(f"{path.stem}-{n}{path.suffix}")


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
    InputError where ``--format`` disagrees with that suffix or names a format for a video model's
    videos, or ``--quality`` is given for a lossless PNG."""
    suffix = single.suffix.lower() if single is not None else None
    if video and (suffix is None or suffix in VIDEO_SUFFIXES):
        for flag, value in (("--format", fmt), ("--quality", quality)):
            if value is not None:
                raise InputError(f"{flag} {value} sets image files' format, and this model writes videos (.webp, .gif "
                               "or .mp4: --out names one)")  # fmt: skip
    named = IMAGE_SUFFIXES.get(suffix) if suffix is not None and not (video and suffix in VIDEO_SUFFIXES) else None
    if fmt is not None and named is not None and fmt != named:
        raise InputError(f"--format {fmt} and --out {str(single)!r} ({named}) disagree: drop one")
    chosen = named or fmt or "png"
    if quality is not None and chosen == "png":
        raise InputError("--quality sets JPEG's and lossy WebP's quality; PNG is lossless (--format jpeg or webp)")
    return ImageOutput(chosen, quality)


def run_resolutions(resolution: Sequence[Size] | None, width: int | None, height: int | None, default: Size,
                    image: Any = None) -> list[Size]:  # fmt: skip
    """The run's sizes: ``--resolution``'s, else ``--width`` and ``--height`` (the missing side
    the ``default``'s), else an input ``image``'s own rounded down to the resolution multiple
    (said in a log line), else ``default``. InputError for ``--resolution`` with either side flag."""
    if resolution and (width or height):
        raise InputError("--width/--height and --resolution both set the size: use one of them")
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
