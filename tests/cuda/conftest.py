"""GPU tests share one process: what a test built is collected when it ends."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

logger = logging.getLogger(__name__)


@pytest.fixture(autouse=True)
def collect_after_test(request: pytest.FixtureRequest):
    """A full-size pipeline is tens of GiB. Diffusers' hooks (a step cache, the ``cache_context``
    of a pipeline call, ours) tie a model to itself in cycles, which reference counting cannot
    free; only the collector does, and it runs by object counts, not by GPU memory. Without
    this the next test's pipeline ran out of memory beside the last ones' (a module-scoped
    fixture's pipeline is collected after its module's last test)."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        logger.info("after %s: %.1f GiB allocated", request.node.name, torch.cuda.memory_allocated() / 2**30)
