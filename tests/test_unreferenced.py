"""No dead names: every top-level function, class and constant of ``accel``, ``pipelines`` and
``scripts``, and every method of their classes, is referenced somewhere else in the project.

A name counts as referenced where any file of the project (tests included) or pyproject.toml
uses an identifier of that spelling: a name, an attribute, an import, or a string that names it
(``getattr``, a lazy export table, an entry point). A ``__all__`` entry is no use, and neither is
a comment or a docstring. That is coarse on purpose (a dead ``close`` hides behind every other
``close``) and never wrong the other way: what it reports is dead. Framework hooks aside: methods
a library calls by name (:data:`FRAMEWORK_HOOKS`) and definitions a registering decorator
(``@register_...``) hands to a registry.

Run as a script, it also lists the names only tests use (``python tests/test_unreferenced.py``).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("accel", "pipelines", "scripts")
# Methods a framework calls by name, never the project: each with who calls it.
FRAMEWORK_HOOKS = {
    "deinitalize_hook": "diffusers' HookRegistry (ModelHook, its spelling)",
    "extra_repr": "torch.nn.Module.__repr__",
    "initialize_hook": "diffusers' HookRegistry (ModelHook)",
    "new_forward": "diffusers' HookRegistry (ModelHook)",
    "reset_state": "diffusers' HookRegistry (ModelHook)",
    "uuid": "inductor's CustomGraphPass cache key",
}
_WORDS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:]*$")


def _files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _uses(tree: ast.Module) -> Counter[str]:
    """Every identifier ``tree`` uses, but its ``__all__`` entries (see the module docstring)."""
    in_all = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        for sub in ast.walk(node.value)
    }
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    uses: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            uses[node.id] += 1
        elif isinstance(node, ast.Attribute):
            uses[node.attr] += 1
        elif isinstance(node, ast.alias):
            uses[node.name.rpartition(".")[2]] += 1
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in in_all | docstrings
            and _IDENTIFIER.match(node.value)
        ):
            uses.update(_WORDS.findall(node.value))
    return uses


def _registered(node: ast.AST) -> bool:
    """Whether a decorator hands ``node`` to a registry (``@register_rule``)."""
    decorators = getattr(node, "decorator_list", [])
    return any((d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")).startswith("register") for d in decorators)


def _definitions(path: Path) -> list[tuple[str, int, ast.AST]]:
    """(name, line, node) of ``path``'s top-level definitions and its classes' methods."""
    found: list[tuple[str, int, ast.AST]] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node.lineno, node))
            if isinstance(node, ast.ClassDef):
                found += [
                    (f"{node.name}.{m.name}", m.lineno, m)
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not (m.name.startswith("__") and m.name.endswith("__"))
                ]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [
                (t.id, node.lineno, node) for t in targets if isinstance(t, ast.Name) and not t.id.startswith("__")
            ]
    return found


def scan() -> tuple[list[str], list[str]]:
    """The unreferenced names (``path:line name``), and those only tests use."""
    source_uses: Counter[str] = Counter(_WORDS.findall((ROOT / "pyproject.toml").read_text(encoding="utf-8")))
    for path in _files(*SOURCES):
        source_uses.update(_uses(ast.parse(path.read_text(encoding="utf-8"))))
    test_uses: Counter[str] = Counter()
    for path in _files("tests"):
        test_uses.update(_uses(ast.parse(path.read_text(encoding="utf-8"))))
    dead, tests_only = [], []
    for path in _files(*SOURCES):
        for name, line, node in _definitions(path):
            short = name.rpartition(".")[2]
            if short in FRAMEWORK_HOOKS or _registered(node) or source_uses[short]:
                continue
            (tests_only if test_uses[short] else dead).append(f"{path.relative_to(ROOT)}:{line} {name}")
    return dead, tests_only


def test_the_scan_finds_a_dead_name_and_passes_a_used_one(tmp_path: Path) -> None:
    tree = ast.parse(
        '__all__ = ["dead", "used"]\n'
        "def dead():\n    'used in a docstring'\n"
        "def used(): ...\n"
        "x = used() or getattr(None, 'attr_named')\n"
    )
    uses = _uses(tree)
    assert uses["used"] == 1 and uses["dead"] == 0 and uses["attr_named"] == 1


def test_nothing_defined_goes_unreferenced() -> None:
    dead, _ = scan()
    assert not dead, "defined but referenced nowhere (delete them, or say in FRAMEWORK_HOOKS who calls them):\n" + (
        "\n".join(dead)
    )


if __name__ == "__main__":
    unreferenced, tested = scan()
    print("unreferenced:", *unreferenced or ["none"], sep="\n  ")
    print("only tests use:", *tested or ["none"], sep="\n  ")
