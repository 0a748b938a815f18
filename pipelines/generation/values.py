"""Argument values, each checked as it is read: the ``type=`` of every flag.

Each function takes the text of one value and returns it parsed, or raises
``argparse.ArgumentTypeError`` with the reason, which argparse prefixes with the flag's name.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..lora import LoraError, LoraSpec, parse_lora
from .constants import MAX_GUIDANCE, MAX_SEED, MAX_STEPS, accel_options


def resolution(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT``, both positive multiples of accel's resolution multiple."""
    try:
        return accel_options().parse_resolution(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def warmup_size(text: str) -> tuple[int, int] | None:
    """A resolution, or None for ``none`` (no warm-up)."""
    if text.strip().lower() == "none":
        return None
    return resolution(text)


def _parsed(text: str, kind: Callable[[str], Any], what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def integer(text: str) -> int:
    return _parsed(text, int, "an integer")


def positive_int(text: str) -> int:
    return at_least(1)(text)


def steps(text: str) -> int:
    value = integer(text)
    # The same words as limits.check_steps, which checks again against the built scheduler.
    if not 1 <= value <= MAX_STEPS:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {MAX_STEPS}, the number of noise levels the scheduler was trained on "
            "(num_train_timesteps); more steps only repeat them"
        )
    return value


def seed(text: str) -> int:
    value = integer(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{value} is outside 0 to 2**63 - 1 ({MAX_SEED}); image i of a run uses seed + i"
        )
    return value


def _number(text: str) -> float:
    return _parsed(text, float, "a number")


def finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def guidance(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or not 0 <= value <= MAX_GUIDANCE:
        raise argparse.ArgumentTypeError(f"{text!r}: the guidance scale must be a number from 0 to {MAX_GUIDANCE:g} "
                                         "(the models here run at 0 to 7.5)")  # fmt: skip
    return value


def side(text: str) -> int:
    """``--width`` or ``--height``: a positive multiple of accel's resolution multiple."""
    value = positive_int(text)
    multiple = accel_options().RESOLUTION_MULTIPLE
    if value % multiple:
        raise argparse.ArgumentTypeError(f"{value} is not a multiple of {multiple}")
    return value


def unit_interval(text: str) -> float:
    """A number above 0, at most 1 (``--strength``)."""
    value = finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0 and at most 1")
    return value


def quality(text: str) -> int:
    value = integer(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 1 to 100, got {value}")
    return value


def positive(text: str, unit: str = "") -> float:
    """A finite number above 0 (``unit``: what it counts, for the message)."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number{unit and ' of ' + unit} above 0")
    return value


def at_least(low: int) -> Callable[[str], int]:
    """An integer flag's parser: the value must be ``low`` or more."""

    def parse(text: str) -> int:
        value = integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def ratios(text: str) -> tuple[float, ...]:
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("is empty: give the calibrated ratios as R1,R2,... (one per step)")
    try:
        return tuple(positive(t) for t in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"each ratio must be a finite number above 0; {e}") from None


def user_path(text: str) -> str:
    """``text`` with a leading ``~`` expanded, as the shell does unless the path is quoted.

    Left as it was, ``--out "~/x.png"`` makes a folder named ``~`` in the current folder.
    """
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise argparse.ArgumentTypeError(f"{text!r}: {text.split(os.sep)[0]} is no user's home folder here")
    return expanded


def path(text: str) -> Path:
    return Path(user_path(text))


def out_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder, or a .png file for a single image")
    if text.strip() == "-":
        raise argparse.ArgumentTypeError("'-': images are not written to stdout; name a .png file or a folder")
    return path(text)


def lora(text: str) -> LoraSpec:
    """``FILE[:SCALE]`` (``NAME=FILE[:SCALE]`` also reads), the scale a finite number; the file is
    checked with the other model flags (:func:`pipelines.generation.model_flags.model_settings`)."""
    try:
        return parse_lora(user_path(text))
    except LoraError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_utf8(text: str) -> str:
    """``text`` if it is valid UTF-8, else ArgumentTypeError naming the first bad byte.

    Arguments that are not UTF-8 reach Python as lone surrogates (PEP 383), which no tokenizer
    takes and no PNG text chunk can hold.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text ({what} at character {e.start})") from None
    return text


def prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt cannot be empty (leave --prompt out for the default prompt)")
    return check_utf8(text)


def model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is empty: name z-image, qwen-image, flux, wan, wan-1.3b, a pipeline folder or a hub id"
        )
    return user_path(text)


def safetensors_file(text: str) -> Path:
    """An existing ``.safetensors`` file (``--transformer``)."""
    file = path(text)
    if file.suffix.lower() != ".safetensors":
        raise argparse.ArgumentTypeError(f"{text!r} is not a .safetensors file (single-file checkpoints are "
                                         "loaded from safetensors only: pickle files can run code)")  # fmt: skip
    if not file.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist" if not file.exists() else f"{text!r} is not a file")
    return file


def scheduler_name(text: str) -> str:
    """A scheduler's class name as diffusers spells it (checked against the model once it is built)."""
    name = text.strip()
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a scheduler class name (e.g. FlowMatchEulerDiscreteScheduler)"
        )
    return name
