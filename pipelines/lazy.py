"""A package's names imported from its modules on first use (PEP 562), so that importing the
package imports none of them: ``bcg-generate --help`` answers before torch loads, and the zoo's
family names come without diffusers."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__`` and ``__dir__`` for ``package`` (call it from the package's ``__init__``
    with ``__name__``), and the names, sorted. ``modules`` maps each submodule to the names it
    gives; a name is imported at its first use and kept in the package's namespace."""
    module_of = {name: module for module, names in modules.items() for name in names}
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *module_of})

    return __getattr__, __dir__, sorted(module_of)
