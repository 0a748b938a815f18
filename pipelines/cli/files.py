"""Image files that appear only once complete, and the part files of killed runs swept.

A file is written to a hidden part file of its own first, renamed once whole; a run killed
meanwhile (SIGKILL, a power cut) leaves its part file behind. The part file's name holds its
writer's process id and host, so the next run writing into that folder removes those whose
writer is gone (:func:`sweep_stale_parts`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import secrets
import socket
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..generation.errors import RunError, one_line
from ..generation.formats import encode_image
from ..generation.png import encode_png


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
    """Give the complete file ``part`` the name ``path``, or the first free ``{stem}-N{suffix}``.

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


def _host() -> str:
    """Four hex digits of this host's name: part files of another host's runs (a shared folder) are never swept."""
    return f"{zlib.crc32(socket.gethostname().encode()) & 0xFFFF:04x}"


# ".fox.png.3f2a-12345-9c1d2e3f.part" (an .mp4's part ends in .part.mp4): host, process, token
_PART = re.compile(r"^\..+\.(?P<host>[0-9a-f]{4})-(?P<pid>[0-9]+)-[0-9a-f]{8}\.part(\.[A-Za-z0-9]+)?$")
# part files named before they held their writer (".fox.png.9c1d2e3f.part"), swept once this old
_OLD_PART = re.compile(r"^\..+\.[0-9a-f]{8}\.part(\.[A-Za-z0-9]+)?$")
_OLD_PART_SECONDS = 24 * 3600


def _part_name(path: Path, part_suffix: str) -> Path:
    return path.with_name(f".{path.name}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}.part{part_suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process (alive), or no such number here
        return True
    return True


def sweep_stale_parts(folder: Path) -> int:
    """Remove the part files in ``folder`` that runs killed before renaming them left behind:
    those of this host whose writing process is gone (and the older kind, without a writer in
    the name, a day after their last write). Returns how many went; a folder that cannot be
    listed, or a file that cannot be removed, is left as it is."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    host, removed = _host(), 0
    for name in names:
        match = _PART.match(name)
        stale = match is not None and match["host"] == host and not _alive(int(match["pid"]))
        if match is None and _OLD_PART.match(name):
            with contextlib.suppress(OSError):
                stale = time.time() - os.stat(folder / name).st_mtime > _OLD_PART_SECONDS
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(folder / name)
                removed += 1
    return removed


def write_whole(path: Path, write: Callable[[Path], None], overwrite: bool = False, part_suffix: str = "") -> Path:
    """Make the file ``path`` with ``write`` (given the file to fill); returns the path written.

    The file appears only once complete: ``write`` fills a hidden file of its own (unique, so
    concurrent runs never share one; its name ends in ``part_suffix``), which is then renamed.
    An existing file is replaced only with ``overwrite``; otherwise one that appeared since the
    run checked (another run writing the same name) is kept, and the new file takes the first
    free name ``{stem}-N{suffix}`` instead. RunError for a file system that refuses.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = _part_name(path, part_suffix)
        # Created here, exclusively and with the umask's permissions; the writer then fills it.
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        with _removed_on_failure(part):
            write(part)
            if overwrite:
                os.replace(part, path)
                return path
            written = _claim(part, path)
            with contextlib.suppress(FileNotFoundError):  # gone already where the name was taken by a rename
                part.unlink()
        return written
    except OSError as e:
        raise RunError(f"cannot write {str(path)!r}: {e.strerror or one_line(e)}") from None


def save_png(image: Any, path: Path, info: dict[str, str], overwrite: bool = False) -> Path:
    """Write ``image`` with ``info`` as PNG text chunks, whole and never over another file
    (:func:`write_whole`); returns the path written."""
    return write_whole(path, lambda part: part.write_bytes(encode_png(image, info)), overwrite)


def save_image(image: Any, path: Path, info: dict[str, str], fmt: str = "png", quality: int | None = None,
               overwrite: bool = False) -> Path:  # fmt: skip
    """Write ``image`` as a ``fmt`` file (:func:`pipelines.generation.formats.encode_image`) with ``info``
    as its record, whole and never over another file (:func:`write_whole`); returns the path written."""
    return write_whole(path, lambda part: part.write_bytes(encode_image(image, info, fmt, quality)), overwrite)


def layer_files(layers: Sequence[Any], path: Path, info: dict[str, str]) -> Iterator[tuple[Any, Path, dict[str, str]]]:
    """Each of a layered image's ``layers`` with the file it goes to, ``path``'s name with
    ``-layerK`` added (K from 0, the pipeline's order), and its record: ``info`` with ``layer``
    (K) and ``layers`` (how many) added."""
    for k, layer in enumerate(layers):
        yield (
            layer,
            path.with_name(f"{path.stem}-layer{k}{path.suffix}"),
            {**info, "layer": str(k), "layers": str(len(layers))},
        )
