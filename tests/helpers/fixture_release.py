"""A hook that lets a higher-scoped fixture's old value go before the next one is built.

A conftest imports :func:`pytest_fixture_setup`. The H200 suite's memory log showed why: a
module's full-size pipelines (19-54 GiB) were still allocated when the next module's first test
began, and Z-Image's pipeline was still allocated while the fixture was built again for
Qwen-Image. A collection when a fixture is finalized frees nothing: pytest drops the fixture's
cached value only after its finalizer hook returns, and a module's last test keeps the value in
its arguments until that test's protocol ends. By the time the next higher-scoped fixture is set
up, both are gone: after a module's end as after a parameter switch.

Each module should start from an empty cache, as a new process would: a capture cannot use the
default pool's cached segments, and once the next module's blocks sit in them, emptying the
cache gives nothing back.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers.memory import log_memory


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    if fixturedef.scope == "function":
        return
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log_memory("before building", f"{fixturedef.argname} for {request.node.nodeid}")
