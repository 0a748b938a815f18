"""Typed options and the constants every layer shares.

:class:`AcceleratorOptions` is what :func:`accel.accelerate_pipeline` was asked for, validated
once, frozen and comparable (calling it again with equal options is a no-op).
:class:`GenerationDefaults` is how a model family is usually run, as a recipe states it for front
ends (the CLI, the benchmark). Both replace string-keyed dicts; the one sentinel left,
:data:`RECIPE_DEFAULT`, is a typed enum member rather than a magic string.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

__all__ = [
    "MODES",
    "PARALLEL_MODES",
    "RECIPE_DEFAULT",
    "RESOLUTION_MULTIPLE",
    "AcceleratorOptions",
    "GenerationDefaults",
    "Mode",
    "Parallel",
    "RecipeDefault",
    "check_resolution",
    "default_compile_cache_dir",
    "parse_resolution",
]

Mode = Literal["bcg", "debug", "eager"]
MODES: tuple[str, ...] = get_args(Mode)

# One image on several processes (accel/parallel): the guidance branches on two ranks, diffusers'
# Ulysses context parallelism over all ranks, or both (two Ulysses groups, one per branch).
Parallel = Literal["cfg", "ulysses", "cfg+ulysses"]
PARALLEL_MODES: tuple[str, ...] = get_args(Parallel)
DEFAULT_PARALLEL_TIMEOUT_S = 300.0

# Both latent dimensions are divided by the VAE factor (8) and then patchified by 2.
RESOLUTION_MULTIPLE = 16

COMPILE_CACHE_ENV = "BCG_COMPILE_CACHE"


class RecipeDefault(enum.Enum):
    """Marks an option whose value the model's recipe chooses."""

    RECIPE = "recipe default"

    def __repr__(self) -> str:
        return "RECIPE_DEFAULT"


RECIPE_DEFAULT = RecipeDefault.RECIPE


def default_compile_cache_dir() -> Path:
    """Where compiled kernels persist between processes: ``$BCG_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/bcg-diffusers/compile`` (``~/.cache/bcg-diffusers/compile``)."""
    env = os.environ.get(COMPILE_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bcg-diffusers" / "compile"


def check_resolution(width: object, height: object) -> tuple[int, int]:
    """``(width, height)`` as ints, or ValueError: positive multiples of :data:`RESOLUTION_MULTIPLE`."""
    if isinstance(width, bool) or isinstance(height, bool):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}")
    try:
        w, h = int(width), int(height)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}") from None
    if (w, h) != (width, height):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}")
    if w <= 0 or h <= 0 or w % RESOLUTION_MULTIPLE or h % RESOLUTION_MULTIPLE:
        raise ValueError(
            f"resolution {w}x{h} cannot be generated: width and height must be positive multiples of "
            f"{RESOLUTION_MULTIPLE}"
        )
    return w, h


_RESOLUTION = re.compile(r"\s*([+-]?\d+)\s*[xX*]\s*([+-]?\d+)\s*")


def parse_resolution(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``, or ValueError naming the text."""
    m = _RESOLUTION.fullmatch(text)
    if not m:
        raise ValueError(f"resolution {text!r} is not WIDTHxHEIGHT (for example 512x512)")
    try:
        return check_resolution(int(m.group(1)), int(m.group(2)))
    except ValueError as e:
        raise ValueError(f"resolution {text!r}: {str(e).split(': ', 1)[-1]}") from None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class AcceleratorOptions:
    """What :func:`accel.accelerate_pipeline` applies; see its docstring for each field.

    ``text_buckets`` is :data:`RECIPE_DEFAULT` (the recipe's own buckets), ``None`` (no padding)
    or a sorted tuple of positive lengths. ``memory_budget_mb`` is None (no limit) or positive.
    ``parallel`` is None (one process) or one of :data:`PARALLEL_MODES`; ``parallel_timeout_s`` is
    how long a rank waits for the others before it fails with an error instead of hanging.
    """

    mode: Mode = "bcg"
    capture_on_miss: bool = False
    text_buckets: tuple[int, ...] | RecipeDefault | None = RECIPE_DEFAULT
    max_entries: int = 32
    max_segments: int = 512
    memory_budget_mb: float | None = None
    compile: bool = False
    compile_cache_dir: Path | None = None
    parallel: Parallel | None = None
    parallel_timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S
    text_encoder: bool = True
    vae: bool = True
    auto_breaks: bool = False
    cfg_batch: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("capture_on_miss", "compile", "text_encoder", "vae", "auto_breaks", "cfg_batch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _positive_int("max_entries", self.max_entries)
        _positive_int("max_segments", self.max_segments)
        budget = self.memory_budget_mb
        if budget is not None and not (
            isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget > 0
        ):
            raise ValueError(f"memory_budget_mb must be a positive number of MiB or None, got {budget!r}")
        buckets = self.text_buckets
        if buckets is not None and buckets is not RECIPE_DEFAULT:
            if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
                raise ValueError(f"text_buckets must be a sequence of positive token counts or None, got {buckets!r}")
            for b in buckets:
                _positive_int("every text bucket", b)
            object.__setattr__(self, "text_buckets", tuple(sorted(set(buckets))))
        if self.compile_cache_dir is not None:
            object.__setattr__(self, "compile_cache_dir", Path(self.compile_cache_dir).expanduser())
        if self.parallel is not None and self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be None or one of {', '.join(PARALLEL_MODES)}; got {self.parallel!r}")
        timeout = self.parallel_timeout_s
        if not (
            isinstance(timeout, (int, float))
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ValueError(f"parallel_timeout_s must be a positive number of seconds, got {timeout!r}")

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget_mb is None else int(self.memory_budget_mb * 2**20)


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """How a model family is usually run, for front ends.

    Attributes:
        steps: denoising steps.
        guidance: the guidance scale (None: leave the pipeline's own default).
        guidance_kwarg: the pipeline argument that takes it (``"guidance_scale"``,
            ``"true_cfg_scale"``) or None when the pipeline takes none.
        cfg_above: classifier-free guidance runs when the guidance is above this.
        default_negative: the negative prompt used when guidance is on and none is given (true
            CFG needs one to run at all), or None.
    """

    steps: int = 30
    guidance: float | None = None
    guidance_kwarg: str | None = None
    cfg_above: float = 1.0
    default_negative: str | None = None
