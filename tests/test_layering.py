"""The layering rule: the core (``accel/``) never imports the model layer (``pipelines/``).

``accel`` works on any diffusers pipeline; model-specific code (recipes, builders, the CLI)
lives in ``pipelines`` and reaches ``accel`` through its public API and the recipe entry points.
An import the other way would make the core depend on the models it is meant to serve.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "accel"
MODEL_LAYER = "pipelines"


def _imports_of(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``, relative imports resolved against accel."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # "from . import x" inside accel stays inside accel
                found.append((node.lineno, "accel" + ("." + node.module if node.module else "")))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def _is_model_layer(module: str) -> bool:
    return module == MODEL_LAYER or module.startswith(MODEL_LAYER + ".")


def test_the_checker_sees_every_import_form() -> None:
    source = (
        "import pipelines\n"
        "import os, pipelines.builders as b\n"
        "from pipelines import builders\n"
        "from pipelines.cli import main\n"
        "def f():\n"
        "    import pipelines.z_image\n"  # inside a function still counts
        "from . import options\n"
        "from pipelines_extra import x\n"  # a different package: not the model layer
    )
    hits = sorted(line for line, module in _imports_of(source, "<test>") if _is_model_layer(module))
    assert hits == [1, 2, 3, 4, 6]


def test_core_files_exist() -> None:
    assert sorted(CORE.glob("*.py")), f"no Python files under {CORE}"


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_accel_never_imports_pipelines(path: Path) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for line, module in _imports_of(path.read_text(encoding="utf-8"), str(path))
        if _is_model_layer(module)
    ]
    assert not bad, "accel/ must not import pipelines/ (the model layer):\n" + "\n".join(bad)
