"""Images to files: the text that says how each was made (A1111's ``parameters`` among it), the
file's bytes, and a file that appears only once complete.

:func:`call_pngs` gives the PNGs of one pipeline call in memory, with the text the CLI writes
into its files (:func:`save_image`), for a front end that sends them rather than writes them.

A file is written to a hidden part file of its own first, renamed once whole; a run killed
meanwhile (SIGKILL, a power cut) leaves its part file behind. The part file's name holds its
writer's process id and host, so the next run writing into that folder removes those whose
writer is gone (:func:`sweep_stale_parts`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import secrets
import socket
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..lora import LoraSpec, describe_loras
from .constants import package_version
from .errors import RunError, _one_line
from .formats import encode_image
from .jobs import Job
from .png import encode_png

logger = logging.getLogger("bcg-generate")

if TYPE_CHECKING:
    from .calls import CallSettings
    from .prompts import TokenCount


def run_text(model: str, device: Any, dtype: Any, call: CallSettings, cache: str | None = None,
             loras: Sequence[LoraSpec] = (), quantize: str | None = None,
             scheduler: str | None = None) -> dict[str, str]:  # fmt: skip
    """The PNG text every image of a run shares: how the calls were made (``cache``: the step
    cache applied, as described when it was; ``loras``: the adapters, by file name and scale;
    ``quantize``: what quantization ran, :func:`quantized`; ``scheduler``: its class name)."""
    text = dict(
        negative_prompt=call.negative_prompt or "",
        steps=str(call.steps),
        guidance="default" if call.guidance is None else f"{call.guidance:g}",
        model=model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        Software=f"bcg-diffusers {package_version()}",
    )
    if scheduler is not None:
        text["scheduler"] = scheduler
    if call.image_note:
        text["input_image"] = call.image_note
    if cache is not None:
        text["cache"] = cache
    if loras:
        text["lora"] = describe_loras(loras)
    if quantize is not None:
        text["quantize"] = quantize
    if call.frames is not None:
        text["frames"] = f"{call.frames} generated, the first written"
    return text


def quantized(pipe: Any) -> str | None:
    """What ``quantize=`` did to ``pipe``'s denoiser, in one line (None where nothing is quantized)."""
    accel = vars(pipe).get("accel")
    quantization = getattr(accel, "quantization", None)
    return quantization.summary() if quantization is not None else None


def image_texts(job: Job, common: Mapping[str, str], mode: str, requested_mode: str,
                tokens: TokenCount | None = None) -> list[dict[str, str]]:  # fmt: skip
    """The PNG text of each image of ``job``: its prompt, seed, size and index, the ``mode`` that
    ran (and the one requested, where another ran), the prompt's ``tokens``, then ``common``
    (:func:`run_text`)."""
    texts = []
    for index, seed in zip(job.indices, job.seeds):
        text = dict(prompt=job.prompt, seed=str(seed), resolution=f"{job.width}x{job.height}", index=str(index),
                    mode=mode)  # fmt: skip
        if mode != requested_mode:
            text["requested_mode"] = requested_mode
        if tokens is not None:
            text["prompt_tokens"] = tokens.describe()
        text.update(common)
        text["parameters"] = parameters(text)
        texts.append(text)
    return texts


def parameters(text: Mapping[str, str]) -> str:
    """An image's record as AUTOMATIC1111's web UI writes its ``parameters`` text, which image
    browsers and other UIs read: the prompt, ``Negative prompt: ...``, then ``Key: value`` pairs."""
    fields = [("Steps", text.get("steps")), ("Sampler", text.get("scheduler")), ("CFG scale", text.get("guidance")),
              ("Seed", text.get("seed")), ("Size", text.get("resolution")), ("Model", text.get("model")),
              ("Denoising strength", _strength(text.get("input_image"))), ("Version", text.get("Software"))]  # fmt: skip
    pairs = ", ".join(f"{key}: {_a1111_value(value)}" for key, value in fields if value)
    lines = [text.get("prompt", "")]
    if text.get("negative_prompt"):
        lines.append(f"Negative prompt: {text['negative_prompt']}")
    return "\n".join([*lines, pairs])


def _strength(note: str | None) -> str | None:
    match = re.search(r"strength ([0-9.]+)", note or "")
    return match.group(1) if match else None


def _a1111_value(value: str) -> str:
    # A1111 quotes a value holding its separators, as JSON does a string
    return json.dumps(value, ensure_ascii=False) if any(c in value for c in ",:\n") else value


def png_bytes(image: Any, text: Mapping[str, str]) -> bytes:
    """``image`` as PNG bytes with ``text`` as its text chunks: the bytes :func:`save_png` writes
    (:func:`~pipelines.cli.png.encode_png`)."""
    return encode_png(image, text)


def call_pngs(images: Sequence[Any], job: Job, common: Mapping[str, str], mode: str, requested_mode: str,
              tokens: TokenCount | None = None) -> list[bytes]:  # fmt: skip
    """The PNGs of one pipeline call's ``images`` (:meth:`PreparedPipeline.generate
    <pipelines.cli.prepare.PreparedPipeline.generate>`), in memory, with the text the CLI writes
    into its files (:func:`image_texts`); nothing is written."""
    return [
        png_bytes(image, text) for image, text in zip(images, image_texts(job, common, mode, requested_mode, tokens))
    ]


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
        raise RunError(f"cannot write {str(path)!r}: {e.strerror or _one_line(e)}") from None


def save_png(image: Any, path: Path, info: dict[str, str], overwrite: bool = False) -> Path:
    """Write ``image`` with ``info`` as PNG text chunks, whole and never over another file
    (:func:`write_whole`); returns the path written."""
    return write_whole(path, lambda part: part.write_bytes(encode_png(image, info)), overwrite)


def save_image(image: Any, path: Path, info: dict[str, str], fmt: str = "png", quality: int | None = None,
               overwrite: bool = False) -> Path:  # fmt: skip
    """Write ``image`` as a ``fmt`` file (:func:`pipelines.cli.formats.encode_image`) with ``info``
    as its record, whole and never over another file (:func:`write_whole`); returns the path written."""
    return write_whole(path, lambda part: part.write_bytes(encode_image(image, info, fmt, quality)), overwrite)
