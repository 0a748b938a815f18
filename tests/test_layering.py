"""The layering rules: each layer imports only the layers below it.

| layer            | may import of this project                                          |
|------------------|---------------------------------------------------------------------|
| ``accel.graphs`` | ``accel.graphs`` (torch only: no diffusers, no transformers)         |
| ``accel.hooks``  | ``accel.graphs``, ``accel.hooks``                                   |
| ``accel.parallel`` | ``accel.graphs``, ``accel.hooks``, ``accel.parallel``             |
| ``accel`` (its ``__init__``) | all of ``accel``                                        |
| ``pipelines``    | ``accel``'s public names (its ``__all__``) and :data:`PUBLIC_MODULES` |

Nothing in ``accel`` imports ``pipelines``: ``accel`` works on any diffusers pipeline, and
model-specific code (recipes, builders, the CLI) reaches it through its public API and the
recipe entry points. An import the other way would make the core depend on what it serves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the packages of this project its modules may import.
LAYERS: dict[str, tuple[str, ...]] = {
    "accel.graphs": ("accel.graphs",),
    "accel.hooks": ("accel.graphs", "accel.hooks"),
    "accel.parallel": ("accel.graphs", "accel.hooks", "accel.parallel"),
    "accel": ("accel",),
}
# Third-party packages a layer must not import (the core is torch only).
FORBIDDEN: dict[str, tuple[str, ...]] = {"accel.graphs": ("diffusers", "transformers", "accelerate")}
# Modules of accel that pipelines may import besides accel's public names, and why.
PUBLIC_MODULES = {
    "accel.hooks.options": "standard library only: the CLI reads its constants and checks before torch is imported",
}
OURS = ("accel", "pipelines")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, imported module, names)`` of every import in ``source`` (the code of ``module``).

    Relative imports are resolved against ``module``'s package; ``names`` are what a
    ``from ... import`` takes (empty for ``import x``).
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target, names))
    return sorted(found, key=lambda f: f[0])


def _public_names() -> set[str]:
    tree = ast.parse((ROOT / "accel" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value)) | {"__version__"}
    raise AssertionError("accel/__init__.py has no __all__")


def _layer_of(module: str) -> str | None:
    return next((layer for layer in sorted(LAYERS, key=len, reverse=True) if _within(module, layer)), None)


def _violations(path: Path) -> list[str]:
    module = _module_name(path)
    where = str(path.relative_to(ROOT))
    imports = _imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    bad: list[str] = []
    if _within(module, "pipelines"):
        public = _public_names()
        for line, target, names in imports:
            if not _within(target, "accel"):
                continue
            if target == "accel":
                hidden = [n for n in names if n not in public]
                if hidden:
                    bad.append(f"{where}:{line}: imports {', '.join(hidden)} from accel, not in accel.__all__")
            elif target not in PUBLIC_MODULES and not any(f"{target}.{n}" in PUBLIC_MODULES for n in names):
                bad.append(f"{where}:{line}: imports {target}, not accel's public API")
        return bad
    layer = _layer_of(module)
    assert layer is not None, module
    for line, target, _names in imports:
        if _within(target, "pipelines"):
            bad.append(f"{where}:{line}: imports {target}: accel never imports pipelines (the model layer)")
        elif _within(target, "accel") and not any(_within(target, ok) for ok in LAYERS[layer]):
            bad.append(f"{where}:{line}: imports {target}; {layer} may import only {', '.join(LAYERS[layer])}")
        for package in FORBIDDEN.get(layer, ()):
            if _within(target, package):
                bad.append(f"{where}:{line}: imports {target}; {layer} is torch only")
    return bad


def test_the_checker_sees_every_import_form() -> None:
    source = (
        "import pipelines\n"
        "import os, pipelines.builders as b\n"
        "from pipelines import builders\n"
        "def f():\n"
        "    from ..hooks import options\n"  # inside a function still counts, resolved
        "from . import bcg\n"
        "from .tree import flatten\n"
        "from pipelines_extra import x\n"  # a different package
    )
    got = [(line, target) for line, target, _ in _imports_of(source, "accel.graphs.runner")]
    assert got == [
        (1, "pipelines"),
        (2, "os"),
        (2, "pipelines.builders"),
        (3, "pipelines"),
        (5, "accel.hooks"),
        (6, "accel.graphs"),
        (7, "accel.graphs.tree"),
        (8, "pipelines_extra"),
    ]
    assert [t for _, t, _ in _imports_of("from . import x\n", "accel.hooks", is_package=True)] == ["accel.hooks"]


def test_the_checker_finds_each_kind_of_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "accel" / "graphs").mkdir(parents=True)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "accel" / "__init__.py").write_text('__all__ = ["accelerate_pipeline"]\n')
    core = tmp_path / "accel" / "graphs" / "runner.py"
    core.write_text("from ..hooks import options\nimport diffusers\nfrom pipelines import cli\n")
    assert [v.split(": ", 1)[1] for v in _violations(core)] == [
        "imports accel.hooks; accel.graphs may import only accel.graphs",
        "imports diffusers; accel.graphs is torch only",
        "imports pipelines: accel never imports pipelines (the model layer)",
    ]
    model = tmp_path / "pipelines" / "recipe.py"
    model.write_text(
        "from accel import accelerate_pipeline, GraphRunner\nimport accel.graphs.bcg\n"
        "from accel.hooks import options\nfrom accel.hooks.options import MODES\n"
    )
    assert [v.split(": ", 1)[1] for v in _violations(model)] == [
        "imports GraphRunner from accel, not in accel.__all__",
        "imports accel.graphs.bcg, not accel's public API",
    ]


def test_every_layer_exists() -> None:
    for layer in LAYERS:
        assert (ROOT.joinpath(*layer.split(".")) / "__init__.py").is_file(), layer
    for module in PUBLIC_MODULES:
        assert ROOT.joinpath(*module.split(".")).with_suffix(".py").is_file(), module


@pytest.mark.parametrize(
    "path",
    sorted(p for package in OURS for p in (ROOT / package).rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_imports_follow_the_layers(path: Path) -> None:
    bad = _violations(path)
    assert not bad, "imports across layers (see tests/test_layering.py):\n" + "\n".join(bad)
