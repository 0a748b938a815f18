"""GPU tests share one process: what a test built is collected when it ends."""

from __future__ import annotations

import gc
import logging
import sys
import traceback

import pytest
import torch

# A hook: pytest finds it in a conftest's namespace by name.
from tests.helpers.fixture_release import pytest_fixture_setup  # noqa: F401
from tests.helpers.memory import log_memory

logger = logging.getLogger(__name__)

# Above what tiny pipelines hold: a full-size model outlived its test (or a module-scoped fixture holds one).
LEFT_AFTER_A_TEST = 2 << 30
PINNED_AFTER_A_TEST = 4 << 30
# Free segments of the default pool that emptying the cache left (it frees every one it can).
STUCK_AFTER_A_TEST = 1 << 30


@pytest.fixture(autouse=True)
def collect_after_test(request: pytest.FixtureRequest):
    """A full-size pipeline is tens of GiB. Diffusers' hooks (a step cache, the ``cache_context``
    of a pipeline call, ours) tie a model to itself in cycles, which reference counting cannot
    free; only the collector does, and it runs by object counts, not by GPU memory. Without
    this the next test's pipeline ran out of memory beside the last ones'. A module-scoped
    fixture's pipeline outlives its module's last test: the hook imported above lets it go
    before the next module's fixtures are built."""
    log_memory("before", request.node.nodeid)
    yield
    # A failed test's frames outlive it: pytest keeps the last failure in sys.last_traceback
    # (for a debugger), and with it the test's pipeline and graphs, so one failure ran every
    # later test out of memory (the GPU suite: one assertion, then 40 OOM and cuBLAS failures).
    tb = getattr(sys, "last_traceback", None)
    if tb is not None:
        traceback.clear_frames(tb)
        sys.last_type = sys.last_value = sys.last_traceback = None
        if hasattr(sys, "last_exc"):
            sys.last_exc = None
    torch._dynamo.reset()  # compiled code holds the modules it was compiled for
    gc.collect()
    if torch.cuda.is_available():
        broken = _broken_device()
        if broken is not None:
            # Every later test would fail with it (the H200 suite: one test ran out of memory,
            # then 50 failed on "unknown error" and cuBLAS failures): stop at the one that broke it.
            pytest.exit(f"the CUDA context broke during {request.node.nodeid}: {broken}", returncode=3)
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left > LEFT_AFTER_A_TEST:
            logger.warning("after %s: %.1f GiB still allocated", request.node.name, left / 2**30)
        # What emptying the cache could not give back: segments that a live block keeps (a
        # capture's pool cannot use them), and free ones while the allocator counts a failed
        # capture as under way (the H200 suite's captures ran out of memory so, beside 118 GiB
        # reserved and 20 allocated, until 16e0f0e).
        log_memory("after", request.node.nodeid)
        stuck = _unpinned_cache()
        if stuck > STUCK_AFTER_A_TEST:
            # Only a capture that the allocator still counts as under way stops it emptying the
            # cache, and then for the rest of the process: every later capture would run short.
            pytest.exit(
                f"after {request.node.nodeid}: {stuck / 2**30:.1f} GiB of free segments stayed cached after "
                "emptying the cache (a failed capture left the allocator routing into its pool)",
                returncode=3,
            )
        pinned = torch.cuda.memory_reserved() - left
        if pinned > PINNED_AFTER_A_TEST:
            logger.warning(
                "after %s: %.1f GiB reserved beyond the %.1f GiB allocated (segments held by live blocks)",
                request.node.name,
                pinned / 2**30,
                left / 2**30,
            )


@pytest.fixture(scope="module", autouse=True)
def clear_cublas_workspaces(request: pytest.FixtureRequest):
    """After a module, give back cuBLAS's workspaces, as PyTorch's own test suite does between
    tests. The module's pipelines are still referenced here (by its last test's arguments);
    :mod:`tests.helpers.fixture_release` lets them go before the next module's are built.
    cuBLAS keeps one workspace per handle and stream (tens of MiB,
    from the caching allocator, for the life of the process), and every graph pool brings a
    capture stream: in the H200 suite 1.2 GiB of them were likely what was still allocated
    beside the 29th test's model, when its captures ran out of memory. Within a module they stay:
    a module-scoped pipeline's graphs replay with the workspace address they were captured with."""
    yield
    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    log_memory("cuBLAS workspaces cleared after", request.module.__name__)


def _unpinned_cache() -> int:
    """Bytes in the default pool's segments that hold no live block (empty_cache frees them all)."""
    return sum(
        s["total_size"]
        for s in torch.cuda.memory._snapshot()["segments"]  # type: ignore[attr-defined]
        if not s["allocated_size"] and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)
    )


def _broken_device() -> str | None:
    """Why the device can no longer compute (a sticky CUDA error, cuBLAS failing), or None."""
    try:
        a = torch.ones(64, 64, device="cuda")
        b = (a @ a).to(torch.bfloat16) @ a.to(torch.bfloat16)
        torch.cuda.synchronize()
        if b[0, 0].item() != 64 * 64:
            return f"a 64x64 product came out {b[0, 0].item()}, not {64 * 64}"
    except Exception as e:  # whatever the driver or cuBLAS raise
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None
