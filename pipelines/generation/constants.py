"""The front ends' constants, and those they borrow without importing torch.

``--help`` and a mistyped option answer in a fraction of a second instead of the 3-5 s that
torch, diffusers and accel's package take to import. So the option constants come from
``accel/hooks/options.py`` and the parallel modes' process counts from ``accel/parallel/layout.py``
(both standard library only), each loaded on its own (:func:`accel_module`), and the few limits the
parser needs are mirrored from :mod:`pipelines.limits` (which imports torch), kept equal by a test.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

DEFAULT_PROMPT = "a red fox in the snow, golden hour"
DEFAULT_MODEL = "z-image"
DEFAULT_RESOLUTION = (512, 512)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip
CACHES = ("fbc", "taylorseer", "magcache", "dbcache")

# A LoRA scale beyond this (either sign) is taken, with a warning: adapters are trained for about 1.
LORA_SCALE_WARNING = 10.0

# Mirrors of pipelines.limits (which imports torch); tests/pipelines/cli/test_startup.py keeps them equal.
MAX_SEED = 2**63 - 1
MAX_STEPS = 1000
MAX_GUIDANCE = 100.0
MEMORY_MARGIN = 1.5


# accel's modules that need only the standard library: the front ends load each on its own, before
# torch (:func:`accel_module`). tests/test_layering.py's PUBLIC_MODULES lists each of them too.
LIGHT_ACCEL_MODULES = ("accel.hooks.options", "accel.parallel.layout")


@cache
def accel_module(name: str) -> ModuleType:
    """``name`` (one of :data:`LIGHT_ACCEL_MODULES`) without running ``accel/__init__`` (which
    imports torch and diffusers).

    The file needs only the standard library, so it is executed on its own under a private name.
    Should it ever need the rest of accel, loading it alone fails and the real module is used:
    slower, never wrong. Where the real module is loaded already, that is the one returned.
    """
    if name not in LIGHT_ACCEL_MODULES:
        raise ValueError(f"{name} is not one of accel's standard-library modules ({', '.join(LIGHT_ACCEL_MODULES)})")
    real = sys.modules.get(name)
    if real is not None:
        return real
    private = "pipelines.generation._" + name.replace(".", "_")
    try:
        package = importlib.util.find_spec("accel")  # a top-level find_spec imports nothing
        locations = list(package.submodule_search_locations or []) if package else []
        path = Path(locations[0]).joinpath(*name.split(".")[1:]).with_suffix(".py")
        spec = importlib.util.spec_from_file_location(private, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} not found")
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module
    except Exception:
        sys.modules.pop(private, None)
        return importlib.import_module(name)


def accel_options() -> ModuleType:
    """``accel.hooks.options`` (the option constants and checks) without torch: :func:`accel_module`."""
    return accel_module("accel.hooks.options")


@cache  # the metadata lookup scans the path (half a millisecond); every served image asks
def package_version() -> str:
    """bcg-diffusers' version, from the installed metadata (no torch import), else accel's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bcg-diffusers")
    except PackageNotFoundError:  # a source tree that was never installed
        from accel import __version__

        return __version__
