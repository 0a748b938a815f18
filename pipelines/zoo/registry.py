"""Every zoo family by name, in the order of :data:`pipelines.zoo.names.NAMES`."""

from __future__ import annotations

from .families import ALL
from .names import NAMES
from .spec import Family

__all__ = ["FAMILIES", "family"]

_BY_NAME = {f.name: f for f in ALL}
if set(_BY_NAME) != set(NAMES):  # a family added in one place only
    raise ImportError(f"zoo families and NAMES differ: {sorted(set(_BY_NAME) ^ set(NAMES))}")
FAMILIES: dict[str, Family] = {name: _BY_NAME[name] for name in NAMES}


def family(name: str) -> Family:
    """The family called ``name``; ValueError listing the names otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown zoo family {name!r}: expected one of {', '.join(NAMES)}") from None
