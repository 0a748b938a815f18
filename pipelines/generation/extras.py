"""The optional extras of bcg-diffusers: which modules each brings, and the one line that names
the ``pip install`` command where one is missing.

Every front end checks the extras a run needs before anything is built or bound, so a missing one
is one line and exit status 2 rather than a traceback after the model was built. Modules are
looked up (``importlib.util.find_spec``), not imported: torchao and cache-dit import torch, which
the checks that need no model must not wait for. The extras' packages are those of
``[project.optional-dependencies]`` in pyproject.toml; a test keeps the two equal.
"""

from __future__ import annotations

import importlib.util

from .errors import InputError

__all__ = ["EXTRAS", "install_command", "missing", "require"]

# The module each package of an extra is imported as, by extra, in pyproject.toml's order.
EXTRAS: dict[str, tuple[str, ...]] = {
    "cache-dit": ("cache_dit",),
    "video": ("imageio", "imageio_ffmpeg"),
    "fp8": ("torchao",),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "python_multipart"),
    "ray": ("ray",),
}


def install_command(extra: str) -> str:
    """The command that installs ``extra``, quoted for a shell (the brackets would glob)."""
    if extra not in EXTRAS:
        raise ValueError(f"no extra {extra!r}: expected one of {', '.join(EXTRAS)}")
    return f'pip install "bcg-diffusers[{extra}]"'


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return True


def missing(extra: str) -> list[str]:
    """The packages of ``extra`` that are not installed, by their distribution names."""
    if extra not in EXTRAS:
        raise ValueError(f"no extra {extra!r}: expected one of {', '.join(EXTRAS)}")
    return [module.replace("_", "-") for module in EXTRAS[extra] if _absent(module)]


def require(extra: str, what: str) -> None:
    """InputError, in one line naming the install command, unless every package of ``extra`` is
    installed; ``what`` is what needs it (``"bcg-serve"``, ``"--out .mp4"``)."""
    absent = missing(extra)
    if absent:
        verb = "is" if len(absent) == 1 else "are"
        raise InputError(f"{what} needs the [{extra}] extra; {', '.join(absent)} {verb} not installed: "
                       f"{install_command(extra)}")  # fmt: skip
