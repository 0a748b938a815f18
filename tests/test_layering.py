"""The layering rules: each layer imports only the layers below it.

| layer            | may import of this project                                          |
|------------------|---------------------------------------------------------------------|
| ``accel.graphs`` | ``accel.graphs`` (torch only: no diffusers, no transformers)         |
| ``accel.hooks``  | ``accel.graphs``, ``accel.hooks``                                   |
| ``accel.parallel`` | ``accel.graphs``, ``accel.hooks``, ``accel.parallel``             |
| ``accel`` (its ``__init__``) | all of ``accel``                                        |
| ``pipelines``    | ``accel``'s public names (its ``__all__``) and :data:`PUBLIC_MODULES` |
| ``scripts/``     | anything of ``accel`` and ``pipelines``, and ``scripts/`` itself    |

Nothing in ``accel`` imports ``pipelines``: ``accel`` works on any diffusers pipeline, and
model-specific code (recipes, builders, the CLI) reaches it through its public API and the
recipe entry points. An import the other way would make the core depend on what it serves.

Inside a layer (:data:`CIRCLE_LAYERS`) no files import each other in a circle, counting imports
inside functions and under ``TYPE_CHECKING``: a circle shows a job in the wrong file. There are
no exceptions: a circle fails the test, which names the imports that make it.

Inside ``pipelines``, the model families (``pipelines/families/<family>/``, :data:`FAMILIES`) sit
below the front ends: they import only the shared helpers of :data:`FAMILIES_MAY_IMPORT`, never
the builders, the CLI or the server that read them; what is read before torch loads (the catalog,
the records and each family's ``models`` module, :data:`TORCH_FREE`) imports the standard library
and :data:`TORCH_FREE` only. Each family folder has a ``models`` module and an ``__init__`` that
names its modules. The front ends (:data:`FRONT_ENDS`: ``bcg-generate`` and ``bcg-serve``) are
siblings over the generation core (:data:`GENERATION`): neither imports the other, and the core
imports neither.

Ray is one front end's engine: only ``pipelines.serve.ray`` (bcg-serve's Ray Serve application)
and the module ``serve run`` reads (``pipelines.serve.ray_app``) import ``ray``, and nothing else
of ``pipelines`` imports them but the one line of ``bcg-serve`` that hands ``--ray`` on
(:data:`RAY_FRONT_END`).

``scripts/`` (the benchmarks, their ``benchkit`` and the GPU machine's ``device/`` scripts) is
above both: nothing in ``accel`` or ``pipelines`` imports it, and it reaches ``accel`` through its
public surface only: ``accel``'s ``__all__``, :data:`PUBLIC_MODULES`, and what a package's
``__init__`` lists in its ``__all__`` (its front door), never a module below one. Its files run with ``scripts/`` on
``sys.path``, so its modules are named from there (``benchkit.rows``, ``bench_breadth``); no two
import each other in a circle, and none is over :data:`MAX_SCRIPT_LINES` lines.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import itertools
import re
import sys
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
# Each imports the standard library only; the front ends load them by file, without accel's package
# (pipelines.generation.constants' LIGHT_ACCEL_MODULES), an import this checker cannot see: hence the test
# that every module loaded so is listed here.
PUBLIC_MODULES = {
    "accel.hooks.options": "standard library only: the front ends read its constants and checks before torch is imported",
    "accel.parallel.layout": "standard library only: bcg-serve --ray sizes a --parallel replica by its rule of how "
    "many processes a mode runs on, before torch is imported",
}
OURS = ("accel", "pipelines")
# The model families: one folder each (pipelines/families/<family>/), and what they may import of
# pipelines besides pipelines.families: the helpers every family shares, none of the front ends
# (builders, limits, cli, serve) or the accessors (pipelines.releases' configs) that read them.
FAMILIES = "pipelines.families"
FAMILIES_MAY_IMPORT = (
    "pipelines.construction",
    "pipelines.lazy",
    "pipelines.releases.encoders",
    "pipelines.releases.spec",
    "pipelines.tokenizer",
    "pipelines.tokenizers_t5_clip",
    "pipelines.zoo.names",
)
# The front ends, siblings over the generation core: none imports another, the core none of them.
GENERATION = "pipelines.generation"
FRONT_ENDS = ("pipelines.cli", "pipelines.serve")
# Read before torch loads (the CLI checks its flags against the catalog): the standard library and
# these only. A name ending in ".*" is one module of every family folder.
TORCH_FREE = (
    "pipelines.families",
    "pipelines.families.records",
    "pipelines.families.catalog",
    "pipelines.families.*",
    "pipelines.families.*.models",
    "pipelines.zoo",
    "pipelines.zoo.names",
    "pipelines.lazy",
)
# accel.hooks' parts, one floor each: what a part may import of accel.hooks besides itself (and
# accel.graphs, as the layer may). The base modules are below every part; the install core (the
# other top-level modules: graph_hook, plan, install, warmup, report, accelerator, ...) is above
# them all. The arrows run one way: no part imports the core, and the parts only those before them.
HOOKS_BASE: dict[str, tuple[str, ...]] = {
    "accel.hooks.options": (),
    "accel.hooks.components": ("accel.hooks.options",),
    "accel.hooks.call_shape": ("accel.hooks.options", "accel.hooks.components"),
}
HOOKS_PARTS: dict[str, tuple[str, ...]] = {
    "accel.hooks.attention": ("accel.hooks.options", "accel.hooks.components"),
    "accel.hooks.caches": (),
    "accel.hooks.compiled": ("accel.hooks.options",),
    "accel.hooks.fp8": ("accel.hooks.options", "accel.hooks.components", "accel.hooks.attention"),
    "accel.hooks.images": (),
    "accel.hooks.recipes": tuple(HOOKS_BASE),
    "accel.hooks.state": (*HOOKS_BASE, "accel.hooks.caches", "accel.hooks.compiled"),
}
MAX_HOOKS_TOP_LEVEL = 12
# Layers whose files must not import each other in a circle.
CIRCLE_LAYERS = ("accel.graphs", "accel.hooks", "accel.parallel", "pipelines")
SCRIPTS = ROOT / "scripts"
# How scripts/ reaches its own modules (the names each script's sys.path makes importable).
SCRIPT_PACKAGES = ("benchkit", "scripts")
MAX_SCRIPT_LINES = 400
# Files of scripts/ still over the limit, each with why; the test skips them until they are split.
SCRIPTS_OVER_THE_LIMIT: dict[str, str] = {}
# The Ray front end, the modules that may import ray, and those of pipelines that may import it.
RAY_FRONT_END = ("pipelines.serve.ray", "pipelines.serve.ray_app")
RAY_FRONT_END_IMPORTED_BY = ("pipelines.serve",)


def _module_name(path: Path, base: Path | None = None) -> str:
    """``path``'s module name, from ``base`` (default: the project root)."""
    parts = list(path.relative_to(ROOT if base is None else base).with_suffix("").parts)
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
        bad += _families_violations(module, where, imports)
        bad += _front_end_violations(module, where, imports)
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


def _package_exports(package: str) -> set[str] | None:
    """The names ``package``'s ``__init__`` lists in ``__all__`` (None: ``package`` is no package of
    this project; an ``__init__`` without ``__all__`` lists none)."""
    init = ROOT.joinpath(*package.split(".")) / "__init__.py"
    if not init.is_file():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _script_violations(path: Path) -> list[str]:
    """Imports of ``path`` (a file of scripts/) that reach ``accel`` below its public surface."""
    where = str(path.relative_to(ROOT))
    bad = []
    for line, target, names in _imports_of(path.read_text(encoding="utf-8"), _module_name(path, SCRIPTS)):
        if not _within(target, "accel") or target in PUBLIC_MODULES:
            continue
        exports = _public_names() if target == "accel" else _package_exports(target)
        if exports is None or not names:
            bad.append(f"{where}:{line}: imports {target}, below accel's public surface")
            continue
        hidden = [n for n in names if n not in exports and f"{target}.{n}" not in PUBLIC_MODULES]
        if hidden:
            bad.append(f"{where}:{line}: imports {', '.join(hidden)} from {target}, which its __all__ does not list")
    return bad


def _is_torch_free(module: str) -> bool:
    """Whether ``module`` is one of :data:`TORCH_FREE` (a pattern's ``*`` stands for one name)."""
    depth = module.count(".")
    return any(fnmatch.fnmatchcase(module, p) and depth == p.count(".") for p in TORCH_FREE)


def _loads_torch_free(target: str, names: tuple[str, ...]) -> bool:
    """Whether importing ``names`` from ``target`` (or ``target`` itself) stays :data:`TORCH_FREE`."""
    top = target.partition(".")[0]
    if top not in OURS:
        return top in sys.stdlib_module_names or top == "__future__"
    modules = _all_modules()
    return all(_is_torch_free(f"{target}.{n}" if f"{target}.{n}" in modules else target) for n in names or ("",))


def _families_violations(module: str, where: str, imports: list[tuple[int, str, tuple[str, ...]]]) -> list[str]:
    """Imports of ``module`` (of pipelines) against the families' rules (:data:`FAMILIES`, :data:`TORCH_FREE`)."""
    bad: list[str] = []
    for line, target, names in imports:
        if _is_torch_free(module):
            if not _loads_torch_free(target, names):
                bad.append(f"{where}:{line}: imports {target}; {module} is read before torch loads")
        elif (
            _within(module, FAMILIES)
            and _within(target, "pipelines")
            and not any(_within(target, ok) for ok in (FAMILIES, *FAMILIES_MAY_IMPORT))
        ):
            bad.append(f"{where}:{line}: imports {target}; a family imports only {', '.join(FAMILIES_MAY_IMPORT)}")
    return bad


def _front_end_violations(module: str, where: str, imports: list[tuple[int, str, tuple[str, ...]]]) -> list[str]:
    """Imports of ``module`` (of pipelines) from a front end it is not part of (:data:`FRONT_ENDS`)."""
    own = next((f for f in FRONT_ENDS if _within(module, f)), None)
    return [
        f"{where}:{line}: imports {target}; a front end is imported only by itself (they are siblings over "
        f"{GENERATION})"
        for line, target, _names in imports
        for front in FRONT_ENDS
        if front != own and _within(target, front)
    ]


def _all_modules() -> frozenset[str]:
    """Every module of this project, by name."""
    return _modules_under(ROOT)


@functools.cache
def _modules_under(root: Path) -> frozenset[str]:
    return frozenset(_module_name(p, root) for package in OURS for p in (root / package).rglob("*.py"))


def _layer_edges(layer: str) -> dict[str, dict[str, str]]:
    """For every module of ``layer``: the modules of the same layer it imports (:func:`_edges`)."""
    return _edges({_module_name(p): p for p in sorted(ROOT.joinpath(*layer.split(".")).rglob("*.py"))})


def _script_edges() -> dict[str, dict[str, str]]:
    """:func:`_edges` of every file under scripts/, named as its scripts import them."""
    return _edges({_module_name(p, SCRIPTS): p for p in sorted(SCRIPTS.rglob("*.py"))})


def _edges(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """For every module of ``files`` (module name -> file): the modules of ``files`` it imports,
    each with where (``path:line`` of the first such import). An import of a package a module is
    inside is no edge (the package is loaded before any of its modules anyway)."""
    edges: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        where = str(path.relative_to(ROOT))
        found = edges.setdefault(module, {})
        for line, target, names in _imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            for name in names or ("",):
                dep = f"{target}.{name}" if name and f"{target}.{name}" in files else target
                while dep and dep not in files:
                    dep = dep.rpartition(".")[0]
                inside = files.get(dep, path).name == "__init__.py" and module.startswith(dep + ".")
                if dep and dep != module and not inside:
                    found.setdefault(dep, f"{where}:{line}")
    return edges


def _circles(edges: dict[str, dict[str, str]]) -> list[frozenset[str]]:
    """Every set of two or more modules that reach each other through imports (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(frozenset(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=sorted)


def _describe_circle(circle: frozenset[str], edges: dict[str, dict[str, str]]) -> str:
    """One shortest round trip through ``circle``'s first module, with the import behind each step."""
    start = min(circle)
    came: dict[str, str] = {}
    todo = [start]
    while todo and start not in came:
        v = todo.pop(0)
        for w in sorted(edges[v]):
            if w in circle and w not in came:
                came[w] = v
                todo.append(w)
    steps = [start]
    while len(steps) == 1 or steps[-1] != start:
        steps.append(came[steps[-1]])
    steps.reverse()
    text = steps[0] + "".join(f" -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(steps))
    others = sorted(circle - set(steps))
    return text + (f"; the circle also holds {', '.join(others)}" if others else "")


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


def test_the_checker_keeps_the_front_ends_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "__init__.py").write_text("__all__ = []\n")
    for package in ("cli", "serve", "generation"):
        (tmp_path / "pipelines" / package).mkdir(parents=True)
    (tmp_path / "pipelines" / "serve" / "engine.py").write_text(
        "from pipelines.cli.calls import x\nfrom pipelines.generation import y\nfrom . import batcher\n"
    )
    (tmp_path / "pipelines" / "generation" / "prepare.py").write_text("from ..serve import z\n")
    (tmp_path / "pipelines" / "cli" / "run.py").write_text("from ..generation.calls import x\n")
    assert [v.split(": ", 1)[1] for v in _violations(tmp_path / "pipelines" / "serve" / "engine.py")] == [
        "imports pipelines.cli.calls; a front end is imported only by itself (they are siblings over "
        "pipelines.generation)"
    ]
    assert [v.split(": ", 1)[1] for v in _violations(tmp_path / "pipelines" / "generation" / "prepare.py")] == [
        "imports pipelines.serve; a front end is imported only by itself (they are siblings over pipelines.generation)"
    ]
    assert _violations(tmp_path / "pipelines" / "cli" / "run.py") == []


def test_the_circle_checker_finds_a_circle_and_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    core = tmp_path / "accel" / "graphs"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("from .a import thing\n")  # its package: no edge back
    (core / "a.py").write_text("from . import b\nfrom . import name_in_init\n")
    (core / "b.py").write_text("import os\n\ndef f():\n    from .c import g\n")  # inside a function
    (core / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import T\n")
    (core / "d.py").write_text("import accel.graphs.a\nfrom ..hooks import x\n")  # imports the circle, not in it
    (core / "e.py").write_text("from .d import y\n")
    edges = _layer_edges("accel.graphs")
    assert edges["accel.graphs.d"] == {"accel.graphs.a": "accel/graphs/d.py:1"}
    assert edges["accel.graphs.a"] == {"accel.graphs.b": "accel/graphs/a.py:1"}
    circles = _circles(edges)
    assert circles == [frozenset({"accel.graphs.a", "accel.graphs.b", "accel.graphs.c"})]
    assert _describe_circle(circles[0], edges) == (
        "accel.graphs.a -> accel.graphs.b (accel/graphs/a.py:1) -> accel.graphs.c (accel/graphs/b.py:4)"
        " -> accel.graphs.a (accel/graphs/c.py:3)"
    )
    assert _circle_failures("accel.graphs") == [f"  {_describe_circle(circles[0], edges)}"]
    (core / "e.py").write_text("from .d import y\nfrom .c import z\n")
    (core / "c.py").write_text("from .e import w\nfrom .a import T\n")
    (core / "d.py").write_text("from .e import v\n")
    edges = _layer_edges("accel.graphs")
    circles = _circles(edges)
    assert circles == [
        frozenset({"accel.graphs.a", "accel.graphs.b", "accel.graphs.c", "accel.graphs.d", "accel.graphs.e"})
    ]
    assert _describe_circle(circles[0], edges) == (
        "accel.graphs.a -> accel.graphs.b (accel/graphs/a.py:1) -> accel.graphs.c (accel/graphs/b.py:4)"
        " -> accel.graphs.a (accel/graphs/c.py:2); the circle also holds accel.graphs.d, accel.graphs.e"
    )


def test_every_layer_exists() -> None:
    for layer in LAYERS:
        assert (ROOT.joinpath(*layer.split(".")) / "__init__.py").is_file(), layer
    for layer in CIRCLE_LAYERS:
        assert (ROOT.joinpath(*layer.split(".")) / "__init__.py").is_file(), layer
    for module in PUBLIC_MODULES:
        assert ROOT.joinpath(*module.split(".")).with_suffix(".py").is_file(), module


def test_the_modules_pipelines_loads_by_file_are_public_and_standard_library_only() -> None:
    """pipelines loads a few modules of accel by file, before torch (``accel_module`` of
    pipelines/generation/constants.py, which names them in ``LIGHT_ACCEL_MODULES``): each is one of
    :data:`PUBLIC_MODULES`, and each of those imports the standard library only."""
    constants = ROOT / "pipelines" / "generation" / "constants.py"
    light = next(
        ast.literal_eval(node.value)
        for node in ast.parse(constants.read_text(encoding="utf-8")).body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LIGHT_ACCEL_MODULES" for t in node.targets)
    )
    unlisted = sorted(set(light) - set(PUBLIC_MODULES))
    assert not unlisted, f"constants.py loads {', '.join(unlisted)} by file: list it in PUBLIC_MODULES, with why"
    bad = []
    for module in PUBLIC_MODULES:
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        for line, target, _names in _imports_of(path.read_text(encoding="utf-8"), module):
            top = target.partition(".")[0]
            if top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}; it is loaded alone, before torch")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "path",
    sorted(p for package in OURS for p in (ROOT / package).rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_imports_follow_the_layers(path: Path) -> None:
    bad = _violations(path)
    assert not bad, "imports across layers (see tests/test_layering.py):\n" + "\n".join(bad)


def _circle_failures(layer: str) -> list[str]:
    """One line per import circle between files of ``layer``, naming its imports."""
    edges = _layer_edges(layer)
    return [f"  {_describe_circle(c, edges)}" for c in _circles(edges)]


@pytest.mark.parametrize("layer", CIRCLE_LAYERS)
def test_no_import_circle_inside_a_layer(layer: str) -> None:
    failures = _circle_failures(layer)
    assert not failures, f"import circles between files of {layer} (a job is in the wrong file: move it):\n" + (
        "\n".join(failures)
    )


def test_the_circle_checker_follows_the_scripts_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SCRIPTS", tmp_path / "scripts")
    kit = tmp_path / "scripts" / "benchkit"
    kit.mkdir(parents=True)
    (kit / "__init__.py").write_text("")
    (kit / "rows.py").write_text("from .table import t\n")  # relative, as benchkit's modules do
    (kit / "table.py").write_text("def f():\n    from benchkit.rows import Row\n")  # absolute, from scripts/
    (tmp_path / "scripts" / "bench_x.py").write_text("from benchkit import rows\nimport benchkit.table\n")
    edges = _script_edges()
    assert edges["bench_x"] == {"benchkit.rows": "scripts/bench_x.py:1", "benchkit.table": "scripts/bench_x.py:2"}
    assert _circles(edges) == [frozenset({"benchkit.rows", "benchkit.table"})]


def test_no_import_circle_in_scripts() -> None:
    edges = _script_edges()
    assert "benchkit.rows" in edges and "bench" in edges  # named as the scripts import them
    failures = [f"  {_describe_circle(c, edges)}" for c in _circles(edges)]
    assert not failures, "import circles between files of scripts/ (a job is in the wrong file: move it):\n" + (
        "\n".join(failures)
    )


def test_nothing_below_imports_the_scripts() -> None:
    bad = []
    for path in sorted(p for package in OURS for p in (ROOT / package).rglob("*.py")):
        module = _module_name(path)
        for line, target, _names in _imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if any(_within(target, package) for package in SCRIPT_PACKAGES):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}, which is scripts/ (above every layer)")
    assert not bad, "\n".join(bad)


def test_the_script_checker_finds_an_import_below_the_public_surface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SCRIPTS", tmp_path / "scripts")
    (tmp_path / "scripts").mkdir()
    part = tmp_path / "accel" / "hooks" / "fp8"
    part.mkdir(parents=True)
    (tmp_path / "accel" / "__init__.py").write_text('__all__ = ["accelerate_pipeline"]\n')
    (tmp_path / "accel" / "hooks" / "__init__.py").write_text('"""No front door."""\n')
    (part / "__init__.py").write_text('__all__ = ["quantize_rows"]\n')
    (part / "scaled_mm.py").write_text("def quantize_rows(): ...\n")
    script = tmp_path / "scripts" / "bench_x.py"
    script.write_text(
        "from accel import accelerate_pipeline, GraphRunner\n"
        "from accel.hooks.fp8 import quantize_rows, scaled_mm\n"
        "from accel.hooks.fp8.scaled_mm import quantize_rows\n"
        "import accel.hooks.fp8\n"
        "from accel.hooks import graph_hook\n"
        "from accel.hooks.options import MODES\n"
    )
    assert [v.split(": ", 1)[1] for v in _script_violations(script)] == [
        "imports GraphRunner from accel, which its __all__ does not list",
        "imports scaled_mm from accel.hooks.fp8, which its __all__ does not list",
        "imports accel.hooks.fp8.scaled_mm, below accel's public surface",
        "imports accel.hooks.fp8, below accel's public surface",
        "imports graph_hook from accel.hooks, which its __all__ does not list",
    ]


@pytest.mark.parametrize("path", sorted(SCRIPTS.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_reach_accel_through_its_public_surface(path: Path) -> None:
    bad = _script_violations(path)
    assert not bad, "imports below accel's public surface (see tests/test_layering.py):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", sorted(SCRIPTS.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_script_is_over_the_line_limit(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if where in SCRIPTS_OVER_THE_LIMIT and lines > MAX_SCRIPT_LINES:
        pytest.skip(f"{lines} lines: {SCRIPTS_OVER_THE_LIMIT[where]}")
    assert lines <= MAX_SCRIPT_LINES, f"{where} has {lines} lines (at most {MAX_SCRIPT_LINES}): split it by job"


def _hooks_violations(path: Path) -> list[str]:
    """Imports of ``path`` (a module of accel.hooks) across :data:`HOOKS_PARTS`' floors."""
    module = _module_name(path)
    floor = next((p for p in (*HOOKS_BASE, *HOOKS_PARTS) if _within(module, p)), None)
    if floor is None:
        return []  # the install core: any part
    allowed = (floor, *(HOOKS_BASE[floor] if floor in HOOKS_BASE else HOOKS_PARTS[floor]))
    where = str(path.relative_to(ROOT))
    imports = _imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    return [
        f"{where}:{line}: imports {target}; {floor} may import of accel.hooks only {', '.join(allowed)}"
        for line, target, _names in imports
        if _within(target, "accel.hooks") and target != "accel.hooks" and not any(_within(target, a) for a in allowed)
    ]


def test_the_hooks_checker_finds_an_arrow_the_wrong_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    part = tmp_path / "accel" / "hooks" / "compiled"
    part.mkdir(parents=True)
    (part / "fused.py").write_text(
        "from ..state.guard import CallGuard\nfrom ..options import X\nfrom . import compile\n"
    )
    (tmp_path / "accel" / "hooks" / "options.py").write_text("from .graph_hook import GraphHook\n")
    assert [v.split(": ", 1)[1] for v in _hooks_violations(part / "fused.py")] == [
        "imports accel.hooks.state.guard; accel.hooks.compiled may import of accel.hooks only "
        "accel.hooks.compiled, accel.hooks.options"
    ]
    assert [v.split(": ", 1)[1] for v in _hooks_violations(tmp_path / "accel" / "hooks" / "options.py")] == [
        "imports accel.hooks.graph_hook; accel.hooks.options may import of accel.hooks only accel.hooks.options"
    ]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "accel" / "hooks").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_parts_of_accel_hooks_import_one_way(path: Path) -> None:
    bad = _hooks_violations(path)
    assert not bad, "imports across accel.hooks' parts (see HOOKS_PARTS in tests/test_layering.py):\n" + "\n".join(bad)


def test_accel_hooks_keeps_its_top_level_small_and_each_part_says_what_it_owns() -> None:
    hooks = ROOT / "accel" / "hooks"
    top = sorted(p.name for p in hooks.glob("*.py"))
    assert len(top) <= MAX_HOOKS_TOP_LEVEL, f"{len(top)} modules at accel/hooks' top level: {', '.join(top)}"
    parts = sorted(p.parent.name for p in hooks.glob("*/__init__.py"))
    assert parts == sorted(p.rpartition(".")[2] for p in HOOKS_PARTS)
    for part in parts:
        doc = ast.get_docstring(ast.parse((hooks / part / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "May import" in doc, f"accel/hooks/{part}/__init__.py must say what it owns and may import"


def test_the_families_checker_finds_each_kind_of_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    family = tmp_path / "pipelines" / "families" / "made_up"
    family.mkdir(parents=True)
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "__init__.py").write_text("__all__ = []\n")
    (tmp_path / "pipelines" / "families" / "records.py").write_text("")
    (family / "models.py").write_text(
        "import math\nimport torch\nfrom ..records import Family\nfrom ... import builders\nfrom .release import X\n"
    )
    (family / "release.py").write_text("from ...releases.spec import Part\nfrom ...cli import main\nimport torch\n")
    assert [v.split(": ", 1)[1] for v in _violations(family / "models.py")] == [
        "imports torch; pipelines.families.made_up.models is read before torch loads",
        "imports pipelines; pipelines.families.made_up.models is read before torch loads",
        "imports pipelines.families.made_up.release; pipelines.families.made_up.models is read before torch loads",
    ]
    assert [v.split(": ", 1)[1] for v in _violations(family / "release.py")] == [
        f"imports pipelines.cli; a family imports only {', '.join(FAMILIES_MAY_IMPORT)}",
        "imports pipelines.cli; a front end is imported only by itself (they are siblings over pipelines.generation)",
    ]


@pytest.mark.parametrize("family", sorted(p.parent for p in (ROOT / "pipelines" / "families").glob("*/__init__.py")),
                         ids=lambda p: p.name)  # fmt: skip
def test_each_family_folder_has_its_record_and_names_its_modules(family: Path) -> None:
    assert (family / "models.py").is_file(), f"{family.name}: a family folder's models.py names its FAMILY"
    doc = ast.get_docstring(ast.parse((family / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(p.stem for p in family.glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if not any(line.startswith(m + " ") for line in doc.splitlines())]
    assert not missing, f"pipelines/families/{family.name}/__init__.py names none of {missing} (one line each)"


@pytest.mark.parametrize("path", sorted((ROOT / "pipelines").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_ray_front_end_imports_ray(path: Path) -> None:
    module = _module_name(path)
    ours = any(_within(module, f) for f in RAY_FRONT_END)
    for line, imported, names in _imports_of(path.read_text(), module, path.name == "__init__.py"):
        if _within(imported, "ray"):
            assert ours, f"{path.relative_to(ROOT)}:{line} imports {imported}: only {', '.join(RAY_FRONT_END)} may"
        reached = [imported, *(f"{imported}.{n}" for n in names)]
        if not ours and module not in RAY_FRONT_END_IMPORTED_BY:
            assert not any(_within(r, f) for r in reached for f in RAY_FRONT_END), (
                f"{path.relative_to(ROOT)}:{line} imports the Ray front end ({imported})"
            )


def _unnamed_modules(init: Path) -> list[str]:
    """The modules and subpackages of ``init``'s package that its docstring does not name."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    folder = init.parent
    parts = [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    parts += [p.parent.name for p in folder.glob("*/__init__.py")]
    return sorted(m for m in parts if not re.search(rf"(?<![\w]){re.escape(m)}(?![\w])", doc))


@pytest.mark.parametrize(
    "init",
    sorted(p for package in OURS for p in (ROOT / package).rglob("__init__.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_package_front_door_names_its_modules(init: Path) -> None:
    """Each package's ``__init__`` is its front door: a docstring that names every module (and
    subpackage) in it, so a reader opening it sees what each one owns."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert doc, f"{init.relative_to(ROOT)} has no docstring"
    missing = _unnamed_modules(init)
    assert not missing, f"{init.relative_to(ROOT)}'s docstring names none of {', '.join(missing)}"
