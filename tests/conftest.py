"""Shared test setup: CUDA tests are skipped where there is no CUDA device. Under pytest-xdist
(the README's ``-n auto --dist loadscope``: each module on one worker, so a module's server or
pipeline fixture is built once) ``auto`` is the CPUs this process may use, at most
:data:`MAX_WORKERS`, and each worker gets its share of them."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Each worker imports torch and diffusers and builds its own tiny pipelines (0.4 GiB with two
# built), and some of its tests start servers and CLI runs as big; past this many, more workers
# mostly add memory, as the slowest modules set the time.
MAX_WORKERS = 8


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: no error where it is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: the CPUs this process may use (xdist's own counts physical cores, so one
    worker on a 2-vCPU machine of one core), at most MAX_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS,
    where set, is xdist's to read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return max(1, min(MAX_WORKERS, _cpus()))


def _share_the_cores() -> None:
    """Under pytest-xdist each worker is a process whose torch would use every core, as would
    the processes its tests start (a CLI run, a server): N workers would run N times too many
    threads. Each gets its share instead, torch's intra-op pool and (through OMP_NUM_THREADS, unless
    set) its subprocesses'. Tiny models gain nothing from more threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    share = max(1, _cpus() // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(min(torch.get_num_threads(), share))


_share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords or "/tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def few_threads():
    """At most two torch CPU threads: tiny models gain nothing from more, and CI boxes are small."""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)
