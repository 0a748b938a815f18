"""The settings of a graph runner, read by each of its parts (dispatch, policy, one capture)."""

from __future__ import annotations

import dataclasses

__all__ = ["RunnerConfig"]


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """The settings of a :class:`~accel.graphs.runner.GraphRunner`.

    Attributes:
        capture_on_miss: capture a new signature on first use instead of running it eagerly.
        max_entries: captured signatures kept; once a new capture succeeds beyond it, the least
            recently used is evicted.
        max_segments: a capture with more segments than this is refused (runs eagerly).
        debug: capture the whole call as one eager break, so the model runs eagerly through the
            same static buffers, replay walk and copies; tells capture bugs from model bugs.
        warmup_runs: eager runs on the capture stream before a capture (lazy caches, autotuning).
        memory_budget: bytes of graph memory (the pool, static inputs, boundary buffers) beyond
            which a capture is refused and its signature runs eagerly; None for no limit.
        auto_breaks: when a capture fails on an operation a graph cannot hold, run the function
            that did it as an eager break and capture again; the graph must then equal an eager
            run of the same inputs (else the signature runs eagerly). Off: the failure is only
            located and named in :attr:`~accel.graphs.runner.GraphRunner.blocked`.
        verify: compare every new graph's output with an eager run of the same inputs, bit for
            bit, before keeping it.
        max_auto_breaks: functions marked for one capture at most.
        max_paths: decision paths captured per signature (a cache's computed and cached steps,
            a keyed break's output shapes); a path beyond runs eagerly.
    """

    capture_on_miss: bool = False
    max_entries: int = 32
    max_segments: int = 512
    debug: bool = False
    warmup_runs: int = 2
    memory_budget: int | None = None
    auto_breaks: bool = False
    verify: bool = False
    max_auto_breaks: int = 8
    max_paths: int = 16

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError("max_entries must be at least 1")
