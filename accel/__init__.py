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

The names below are the public API, by audience:

* **Pipeline users**: :func:`accelerate_pipeline` and its :class:`AcceleratorOptions`, the
  :class:`PipelineAccelerator` it puts on ``pipe.accel`` (``warmup`` gives a :class:`WarmupReport`),
  the errors a call can raise, :func:`check_quantize` (can ``quantize=`` run here), and the
  images of a pipeline's decoded batch made on its device (:func:`check_pixels`,
  :func:`to_pil_images`).
* **Recipe authors**: :class:`Recipe` (its docstring says what to override) and
  :class:`GenericRecipe`, :class:`GenerationDefaults`, :class:`WarmupCase`,
  :func:`register_recipe` and :func:`recipe_for`; the tools a recipe marks and swaps functions
  with (:func:`eager_on_graph`, :func:`patch`, :func:`unpatched`, :mod:`tree`); and the building
  blocks of compiled and float8 forms.
* **Low-level capture**, for any callable: :class:`GraphRunner` over a :class:`GraphPool`,
  :func:`capture` into a :class:`BreakableCUDAGraph`, :func:`break_graph`, and the pool's memory
  counters.

Model recipes and front ends (the ``pipelines`` package) and the scripts use only these, the
names each package's ``__init__`` lists, and :mod:`accel.hooks.options`, which needs only the
standard library and is read by the command line before torch is imported.
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
)
from .graphs.errors import BCGError
from .graphs.patches import patch, unpatched
from .graphs.pool import GraphPool, peak_memory, reset_peak_memory
from .graphs.runner import GraphMemoryBudgetError, GraphRunner
from .hooks.accelerator import DENOISER_NAMES, PipelineAccelerator, accelerate_pipeline
from .hooks.call_shape import warmup_image
from .hooks.compiled.fused import addmm_gelu_tanh, fusable_linear, fuse_swiglu_inputs
from .hooks.compiled.gated_residual import gated_residual
from .hooks.compiled.head_norm import head_norm_rope
from .hooks.fp8.norm_quant import modulated_norm_rows_e4m3
from .hooks.fp8.quantizers import QuantizeError, check_quantize
from .hooks.fp8.scaled_mm import Float8RowwiseLinear, PendingRows
from .hooks.images.convert import check_pixels, to_pil_images
from .hooks.options import AcceleratorOptions
from .hooks.recipes.generic import GenericRecipe
from .hooks.recipes.recipe import GenerationDefaults, Recipe, RecipeError, WarmupCase
from .hooks.recipes.registry import diffusers_in, recipe_for, register_recipe
from .hooks.report import WarmupReport
from .hooks.state.guard import BusyError
from .parallel import ParallelConfigError, ParallelError

__all__ = [  # noqa: RUF022 (by audience, as the docstring lists them)
    # Pipeline users: the accelerator, its options and report, the errors a call can raise.
    "accelerate_pipeline",
    "AcceleratorOptions",
    "PipelineAccelerator",
    "WarmupReport",
    "DENOISER_NAMES",
    "check_quantize",
    "check_pixels",
    "to_pil_images",
    "BCGError",
    "BusyError",
    "GraphMemoryBudgetError",
    "ParallelConfigError",
    "ParallelError",
    "QuantizeError",
    # Recipe authors: the interface, the registry, marks and patches, compiled and float8 forms.
    "Recipe",
    "GenericRecipe",
    "GenerationDefaults",
    "WarmupCase",
    "RecipeError",
    "register_recipe",
    "recipe_for",
    "diffusers_in",
    "eager_on_graph",
    "patch",
    "unpatched",
    "tree",
    "warmup_image",
    "fusable_linear",
    "addmm_gelu_tanh",
    "fuse_swiglu_inputs",
    "head_norm_rope",
    "gated_residual",
    "Float8RowwiseLinear",
    "PendingRows",
    "modulated_norm_rows_e4m3",
    # Low-level capture, for any callable.
    "GraphRunner",
    "GraphPool",
    "capture",
    "BreakableCUDAGraph",
    "break_graph",
    "BreakError",
    "CopyBackError",
    "NestedBreakError",
    "peak_memory",
    "reset_peak_memory",
]

__version__ = "0.1.0"
