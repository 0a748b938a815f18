"""bcg-diffusers: breakable CUDA graphs for diffusers pipelines.

    from accel import accelerate_pipeline
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(512, 512), (1024, 1024)])

The graph core (:mod:`accel.bcg`) and the runner (:mod:`accel.runner`) work on any callable;
:mod:`accel.pipeline` applies them to diffusers pipelines through model recipes
(:mod:`accel.hook`, :mod:`accel.guard`, :mod:`accel.warmup`; options in :mod:`accel.options`).
"""

from .bcg import (
    BreakableCUDAGraph,
    BreakError,
    CopyBackError,
    NestedBreakError,
    break_graph,
    capture,
    eager_on_graph,
    is_capturing,
)
from .options import AcceleratorOptions, GenerationDefaults
from .pipeline import PipelineAccelerator, accelerate_pipeline
from .pool import GraphPool
from .runner import GraphMemoryBudgetError, GraphRunner, RunnerStats
from .warmup import WarmupReport

__all__ = [
    "AcceleratorOptions",
    "BreakError",
    "BreakableCUDAGraph",
    "CopyBackError",
    "GenerationDefaults",
    "GraphMemoryBudgetError",
    "GraphPool",
    "GraphRunner",
    "NestedBreakError",
    "PipelineAccelerator",
    "RunnerStats",
    "WarmupReport",
    "accelerate_pipeline",
    "break_graph",
    "capture",
    "eager_on_graph",
    "is_capturing",
]

__version__ = "0.1.0"
