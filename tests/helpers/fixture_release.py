"""Hooks that let a module-scoped fixture's value go before the next module's fixtures are built.

A conftest imports both hooks. pytest keeps a finalized fixture's value in two places for a
while. The fixture's own cached result is dropped only after ``pytest_fixture_post_finalizer``
returns. And at a module's end, the last test's ``funcargs`` keep it until that test's whole
protocol is over. A collection inside the finalizer hook therefore freed nothing. The H200 suite's
memory log showed it: a module's full-size pipelines (19-54 GiB) were still allocated when the
next module's first test began, and Z-Image's pipeline was still allocated when the fixture was
built again for Qwen-Image. Each module should start from an empty cache, as a new process
would: a capture cannot use the default pool's cached segments, and once the next module's
blocks sit in them, emptying the cache gives nothing back. These hooks collect once nothing
holds the value any more:

- a parameter switch inside a module (the old value is finalized while the next test is set
  up): in the finalizer hook, after dropping the cached result, which pytest drops next anyway;
- a module's end (finalized during its last test's teardown): in ``pytest_runtest_logfinish``,
  which pytest calls after it has cleared that test's ``funcargs``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers.memory import log_memory

_released: list[str] = []  # higher-scoped fixtures finalized since the last test ended


def _collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# trylast: pytest's own hook (--setup-show's TEARDOWN line) reads the cached result first.
@pytest.hookimpl(trylast=True)
def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    if fixturedef.scope == "function":
        return
    fixturedef.cached_result = None
    _released.append(fixturedef.argname)
    _collect()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if not _released:
        return
    _collect()
    log_memory("fixtures let go", f"after {nodeid} ({', '.join(_released)})")
    _released.clear()
