"""bcg-diffusers: breakable CUDA graphs for diffusers pipelines.

    from accel import accelerate_pipeline
    accelerate_pipeline(pipe)
    pipe.accel.warmup([(512, 512), (1024, 1024)])

Three layers, each importing only those before it:

* :mod:`accel.graphs`: the torch-only core. Breakable graphs (:mod:`accel.graphs.bcg`) and their
  runner (:mod:`accel.graphs.runner`) work on any callable.
* :mod:`accel.hooks`: the diffusers integration. :func:`accelerate_pipeline` applies graph runners
  to a pipeline's modules through model recipes (:class:`Recipe`).
* :mod:`accel.parallel`: one image on several GPUs (``parallel=``).

The names below are the public API; model recipes and front ends (the ``pipelines`` package)
use only these, plus :mod:`accel.hooks.options`, which needs only the standard library and is
read by the command line before torch is imported.
"""

from .graphs import tree
from .graphs.bcg import (
    BreakableCUDAGraph,
    BreakError,
    CopyBackError,
    NestedBreakError,
    break_graph,
    capture,
    eager_on_graph,
    is_capturing,
)
from .graphs.errors import BCGError
from .graphs.patches import patch, unpatched
from .graphs.pool import GraphPool, peak_memory, reset_peak_memory
from .graphs.runner import GraphMemoryBudgetError, GraphRunner, RunnerStats
from .hooks.accelerator import DENOISER_NAMES, PipelineAccelerator, accelerate_pipeline
from .hooks.call_shape import warmup_image
from .hooks.compiled.fused import addmm_gelu_tanh, fusable_linear
from .hooks.fp8.norm_quant import modulated_norm_rows_e4m3
from .hooks.fp8.quantizers import QuantizeError, check_quantize
from .hooks.fp8.scaled_mm import Float8RowwiseLinear
from .hooks.images.convert import PixelCheck, check_pixels, to_pil_images
from .hooks.options import AcceleratorOptions
from .hooks.recipes.generic import GenericRecipe
from .hooks.recipes.recipe import GenerationDefaults, Recipe, RecipeError, WarmupCase, check_heads_divisible
from .hooks.recipes.registry import diffusers_in, recipe_for, register_recipe
from .hooks.state.guard import BusyError
from .hooks.warmup import WarmupReport
from .parallel import ParallelConfigError, ParallelError

__all__ = [
    "DENOISER_NAMES",
    "AcceleratorOptions",
    "BCGError",
    "BreakError",
    "BreakableCUDAGraph",
    "BusyError",
    "CopyBackError",
    "Float8RowwiseLinear",
    "GenerationDefaults",
    "GenericRecipe",
    "GraphMemoryBudgetError",
    "GraphPool",
    "GraphRunner",
    "NestedBreakError",
    "ParallelConfigError",
    "ParallelError",
    "PipelineAccelerator",
    "PixelCheck",
    "QuantizeError",
    "Recipe",
    "RecipeError",
    "RunnerStats",
    "WarmupCase",
    "WarmupReport",
    "accelerate_pipeline",
    "addmm_gelu_tanh",
    "break_graph",
    "capture",
    "check_heads_divisible",
    "check_pixels",
    "check_quantize",
    "diffusers_in",
    "eager_on_graph",
    "fusable_linear",
    "is_capturing",
    "modulated_norm_rows_e4m3",
    "patch",
    "peak_memory",
    "recipe_for",
    "register_recipe",
    "reset_peak_memory",
    "to_pil_images",
    "tree",
    "unpatched",
    "warmup_image",
]

__version__ = "0.1.0"
