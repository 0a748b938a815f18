"""Jobs: what to generate (the prompts file read), and which process generates it."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from ..generation.calls import Job
from ..generation.errors import InputError, one_line


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a file: one a line, blank lines and ``#`` comments skipped."""
    if str(path) == "-":
        raise InputError("--prompts-file -: prompts are not read from stdin; name a file (or pass --prompt)")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not part of a prompt
    except FileNotFoundError:
        raise InputError(f"--prompts-file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"--prompts-file {str(path)!r} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"--prompts-file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"cannot read --prompts-file {str(path)!r}: {e.strerror or one_line(e)}") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise InputError(f"--prompts-file {str(path)!r} holds no prompts (blank lines and # comments are skipped)")
    for number, line in enumerate(text.splitlines(), 1):
        if "\0" in line:  # a PNG text chunk ends at a NUL byte: the prompt could not be recorded
            raise InputError(
                f"--prompts-file {str(path)!r} line {number} holds a NUL byte (UTF-16 text? save it as UTF-8)"
            )
    return prompts


def plan_jobs(prompts: Sequence[str], resolutions: Sequence[tuple[int, int]], batch_size: int, seed: int,
              count: int | None = None) -> list[Job]:  # fmt: skip
    """Every (prompt, resolution) pair, prompt-major, ``count`` images each (default
    ``batch_size``), in calls of at most ``batch_size`` images."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    count = batch_size if count is None else count
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    jobs: list[Job] = []
    index = 0
    for prompt in prompts:
        for width, height in resolutions:
            for start in range(0, count, batch_size):
                indices = tuple(range(index + start, index + min(start + batch_size, count)))
                jobs.append(Job(prompt, width, height, indices, tuple(seed + i for i in indices)))
            index += count
    return jobs


def shard(jobs: Sequence[Job], process_index: int, num_processes: int) -> list[Job]:
    """This process's contiguous share of ``jobs``.

    The same split as accelerate's ``PartialState.split_between_processes`` (without padding):
    the first ``len(jobs) % num_processes`` processes take one job more.
    """
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process {process_index} of {num_processes} does not exist")
    per, extra = divmod(len(jobs), num_processes)
    start = process_index * per + min(process_index, extra)
    end = start + per + (1 if process_index < extra else 0)
    return list(jobs[start:end])


_NOT_A_WORD = re.compile(r"[^a-z0-9]+")
# Latin letters that NFKD leaves whole (they are letters of their own, not accented ones), spelled
# as their languages spell them in ASCII.
_NO_DECOMPOSITION = str.maketrans({"æ": "ae", "œ": "oe", "ø": "o", "đ": "d", "ð": "d", "þ": "th", "ł": "l", "ı": "i"})


def transliterate(text: str) -> str:
    """``text`` case-folded, its letters without their accents: "Über Straße" -> "uber strasse".

    NFKD splits an accented letter into its base and combining marks, which are then dropped;
    case folding comes first because it can itself make combining marks ("İ" -> "i̇"). A few Latin
    letters that do not decompose (æ, ø, ł ...) are spelled out; letters with no ASCII base (CJK,
    Cyrillic) are left as they are.
    """
    decomposed = unicodedata.normalize("NFKD", text.casefold().translate(_NO_DECOMPOSITION))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def slug(text: str) -> str:
    """Lower-case ASCII words joined by '-', accented letters kept by their base letter: safe in a
    file name on any system."""
    s = _NOT_A_WORD.sub("-", transliterate(text)).strip("-")
    return s or "image"


def image_filename(index: int, prompt: str, width: int, height: int, seed: int, suffix: str = ".png") -> str:
    return f"{index:04d}-{slug(prompt)[:40].rstrip('-')}-{width}x{height}-s{seed}{suffix}"


def file_names(job: Job, suffix: str = ".png") -> list[str]:
    """The file name of each image (or video) of ``job``, ending in ``suffix``."""
    return [image_filename(i, job.prompt, job.width, job.height, s, suffix) for i, s in zip(job.indices, job.seeds)]
