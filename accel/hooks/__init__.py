"""The diffusers integration: hooks that put graph runners into a pipeline's modules.

It builds on :mod:`accel.graphs` and never imports :mod:`accel.parallel` (which registers itself
with :mod:`accel.hooks.accelerator`). A base, seven parts (one concern each; each part's
``__init__`` says what it owns and may import) and the install core above them:

The base:

options      the options of ``accelerate_pipeline``, and the constants every layer shares
             (standard library only)
components   the parts of a pipeline the library accelerates, by their component names
call_shape   how a pipeline is called, read from its ``__call__`` signature and components

The parts:

caches       step caches under graphs (diffusers' and cache-dit's), their rules and contexts
compiled     what ``compile=True`` puts inside the graphs
fp8          ``quantize="fp8"``: quantizers, float8 layers, the layers measured and kept
attention    attention backends: FlashAttention-3 in diffusers' dispatch, ``attention=``
images       a decoded batch to PIL images on its device; the VAE decoder's graphs where they pay
recipes      what the library knows of a model family, behind one interface
state        Python state that decides which code a captured forward runs, checked per call

The install core:

graph_hook   the diffusers hook that puts a graph runner into one module
cfg_batch    both guidance branches of a step in one batched denoiser call
warmup_plan  what the user asked to warm up, checked, as the cases the recipe's calls capture
plan         what an install will put into a pipeline, decided in one pass
install      the plan put into a pipeline, layer by layer, and taken out again
warmup       a warm-up plan's calls run, so that exactly the signatures real calls hit are captured
report       ``pipe.accel.report()`` and a warm-up's report: what was done, in lines a person reads
accelerator  ``pipe.accel``: the accelerator of one pipeline (``accelerate_pipeline`` attaches it)

Beyond ``accel``'s own names, the front door gives the hook's parts that benchmarks time or turn
off: one module's graph runner put in and taken out (``apply_graph_runner``,
``remove_graph_runner``, ``HOOK_NAME``), a module's joined-guidance hook (``cfg_batch_hook_of``),
runners called without capture (``uncaptured``), and :mod:`graph_hook` itself.
"""

from . import graph_hook
from .cfg_batch import cfg_batch_hook_of
from .graph_hook import HOOK_NAME, apply_graph_runner, remove_graph_runner
from .warmup import uncaptured

__all__ = ["HOOK_NAME", "apply_graph_runner", "cfg_batch_hook_of", "graph_hook", "remove_graph_runner", "uncaptured"]
