"""Images to PNG: the text that says how each was made, the PNG's bytes, and a file that
appears only once complete.

:func:`call_pngs` gives the PNGs of one pipeline call in memory, with the text the CLI writes
into its files (:func:`save_png`), for a front end that sends them rather than writes them.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..lora import LoraSpec, describe_loras
from .constants import package_version
from .errors import RunError, _one_line
from .jobs import Job
from .png import encode_png

if TYPE_CHECKING:
    from .calls import CallSettings
    from .prompts import TokenCount


def run_text(model: str, device: Any, dtype: Any, call: CallSettings, cache: str | None = None,
             loras: Sequence[LoraSpec] = (), quantize: str | None = None) -> dict[str, str]:  # fmt: skip
    """The PNG text every image of a run shares: how the calls were made (``cache``: the step
    cache applied, as described when it was; ``loras``: the adapters, by file name and scale;
    ``quantize``: what quantization ran, :func:`quantized`)."""
    text = dict(
        negative_prompt=call.negative_prompt or "",
        steps=str(call.steps),
        guidance="default" if call.guidance is None else f"{call.guidance:g}",
        model=model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        Software=f"bcg-diffusers {package_version()}",
    )
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
        texts.append(text)
    return texts


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
        part = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part{part_suffix}")
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
