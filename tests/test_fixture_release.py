"""The GPU suite's hook lets a module-scoped fixture's value go before the next one is built.

The run is a small pytest run in a subprocess. Its fixtures hold objects in reference cycles,
and automatic collection is off, so only an explicit collection frees them. Each fixture asserts
at setup that no earlier fixture's object is alive. Without the hook, the same run fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

REGISTRY = """
import weakref

refs = []


class Held:
    # A cycle, as diffusers' hooks tie a model to itself: only the collector frees it.
    def __init__(self):
        self.me = self


def build():
    alive = [name for name, ref in refs if ref() is not None]
    assert not alive, f"still alive while the next fixture is built: {alive}"
    held = Held()
    refs.append((len(refs), weakref.ref(held)))
    return held
"""

SWITCHED = """
import pytest
import registry


@pytest.fixture(scope="module", params=["a", "b"])
def pipe(request):
    yield registry.build()


def test_one(pipe):
    assert pipe.me is pipe


def test_two(pipe):
    assert pipe.me is pipe
"""

PLAIN = """
import pytest
import registry


@pytest.fixture(scope="module")
def pipe():
    return registry.build()


def test_it(pipe):
    assert pipe.me is pipe
"""

# A parameter switch inside one module; a module's end, then the next module.
SCENARIOS = {"switch": {"test_a.py": SWITCHED}, "module-end": {"test_b.py": PLAIN, "test_c.py": PLAIN}}
# Collections when a fixture is finalized: as the GPU conftest had it, and also dropping the
# cached value first. Neither frees a value that a module's last test still holds.
AS_BEFORE = """
def pytest_fixture_post_finalizer(fixturedef, request):
    if fixturedef.scope != "function":
        gc.collect()
"""
DROPPING_FIRST = """
def pytest_fixture_post_finalizer(fixturedef, request):
    if fixturedef.scope != "function":
        fixturedef.cached_result = None
        gc.collect()
"""
OURS = "from tests.helpers.fixture_release import pytest_fixture_setup\n"


def run(tmp_path: Path, scenario: str, hooks: str) -> str:
    conftest = "import gc\n\ngc.disable()\n" + hooks
    files = {"conftest.py": conftest, "registry.py": REGISTRY, **SCENARIOS[scenario]}
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    env.pop("BCG_TEST_MEMORY_LOG", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(
    "hooks, lets_go",
    [
        (OURS, {"switch", "module-end"}),
        (DROPPING_FIRST, {"switch"}),  # a module's end: its last test still holds the value
        (AS_BEFORE, set()),
        ("", set()),
    ],
    ids=["ours", "dropping-first", "as-before", "neither"],
)
def test_a_module_fixture_is_let_go_before_the_next_is_built(
    tmp_path: Path, scenario: str, hooks: str, lets_go: set[str]
) -> None:
    out = run(tmp_path, scenario, hooks)
    if scenario in lets_go:
        assert {"switch": "4 passed in", "module-end": "2 passed in"}[scenario] in out, out
        assert "error" not in out.lower(), out
    else:  # the second fixture's setup fails (and, for a parameter, every test that shares it)
        assert {"switch": "2 passed, 2 errors in", "module-end": "1 passed, 1 error in"}[scenario] in out, out
        assert "still alive while the next fixture is built: [0]" in out, out
