"""The install walk: what :func:`accelerate_pipeline` puts into a diffusers pipeline, and takes out again.

The walker finds every denoiser (``transformer``, ``transformer_2``, ``unet``) and, as
components, the text encoders and the VAE's decoder, and applies a
:class:`~accel.hooks.graph_hook.GraphHook` to each (one per module, shared by every pipeline
that uses the module); all of a pipeline's graphs share one pool, so the decode's activations
reuse the denoiser's. A :class:`~accel.hooks.guard.CallGuard` on the scheduler serialises calls
and checks the denoisers' weights once per call (components check theirs as they are called).
With ``parallel=`` one image is computed by several processes (a session from
:mod:`accel.parallel`, which registers itself here: this layer never imports it); each rank runs
the components (which hold no collectives) with its own graphs. With ``cfg_batch`` the two
guidance branches of a step may run as one call (:mod:`accel.hooks.cfg_batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..graphs.errors import BCGError
from ..graphs.pool import GraphPool
from .cfg_batch import CFGBatchHook, apply_cfg_batch, remove_cfg_batch
from .graph_hook import GraphHook, apply_graph_runner, module_device, remove_graph_runner
from .guard import CallGuard
from .options import AcceleratorOptions
from .quantize import Quantization, plan_quantization

__all__ = ["DENOISER_NAMES", "Installation", "ParallelSession", "register_parallel_session"]

DENOISER_NAMES = ("transformer", "transformer_2", "unet")
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
VAE_DECODER = "vae.decoder"


class ParallelSession(Protocol):
    """What the accelerator asks of a several-process session (:class:`accel.parallel.ParallelSession`)."""

    layout: Any

    def check_same(self, what: str, lines: list[str]) -> None: ...

    def describe(self) -> str: ...

    def restore(self) -> None: ...

    def shutdown(self) -> None: ...


# accel.parallel sits above this layer, so this layer never imports it: importing it (accel's
# __init__ does) registers the session here.
_parallel_session: Callable[..., ParallelSession] | None = None


def register_parallel_session(factory: Callable[..., ParallelSession]) -> None:
    """Make ``factory(pipe, denoisers, guard, options)`` build the session for ``parallel=``."""
    global _parallel_session
    _parallel_session = factory


def component(pipe: Any, name: str) -> torch.nn.Module | None:
    """The module at a dotted component path (``"vae.decoder"``), if there is one."""
    obj = pipe
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.nn.Module) else None


def components(pipe: Any, options: AcceleratorOptions) -> list[str]:
    """Names of the non-denoiser modules that get graphs under ``options``."""
    names = list(TEXT_ENCODER_NAMES) if options.text_encoder else []
    if options.vae:
        names.append(VAE_DECODER)
    return [n for n in names if component(pipe, n) is not None]


class Installation:
    """What one accelerator installed in one pipeline; :meth:`uninstall` takes all of it out.

    Attributes:
        hooks: the graph hook of each accelerated module, denoisers first, then components
            (text encoders, the VAE decoder), by component name.
        denoisers: the names of the denoisers among ``hooks``.
        guard: the scheduler's call guard (None where the pipeline has no scheduler to hook).
        parallel: the several-process session, or None.
        cfg_batch: the guidance-batching hook of each denoiser that has one.
        quantization: what ``quantize=`` does to the denoisers (:mod:`accel.hooks.quantize`),
            or None.
    """

    def __init__(self, pipe: Any, options: AcceleratorOptions) -> None:
        self.pipe = pipe
        self.options = options
        self.hooks: dict[str, GraphHook] = {}
        self.denoisers: list[str] = []
        self.guard: CallGuard | None = None
        self.parallel: ParallelSession | None = None
        self.cfg_batch: dict[str, CFGBatchHook] = {}
        self.quantization: Quantization | None = None
        self._own_pool: GraphPool | None = None
        try:
            self._install()
        except BaseException:
            self.uninstall()
            raise

    def _install(self) -> None:
        pipe, options = self.pipe, self.options
        # Refused (one line) before anything is installed; quantizes nothing until the warm-up.
        self.quantization = plan_quantization(pipe, options, DENOISER_NAMES)
        for name in DENOISER_NAMES:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                pool = self.pool_for(module_device(module))
                self.hooks[name] = apply_graph_runner(module, options, name=name, user=self, pool=pool)
                self.denoisers.append(name)
        if not self.hooks:
            raise ValueError(
                f"{type(pipe).__name__} has no denoiser to accelerate (looked for components named "
                f"{', '.join(DENOISER_NAMES)})"
            )
        known = self.hooks[self.denoisers[0]].recipe.component_breaks()
        for name in components(pipe, options):
            module = component(pipe, name)
            assert module is not None
            self.hooks[name] = apply_graph_runner(
                module,
                options,
                name=name,
                user=self,
                pool=self.pool_for(module_device(module)),
                component=True,
                breaks=known.get(name, ()),
                offload_root=component(pipe, name.split(".")[0]),
            )
        self.guard = CallGuard.attach(pipe, self, self._follow_weights)
        if self.guard is not None:
            for name in self.denoisers:
                hook = self.hooks[name]
                if hook.caches is not None:
                    self.guard.listen(hook.caches, begin=hook.new_call, end=hook.caches.end_call)
        if options.parallel is not None:
            # Collective: every rank of the launch builds its session here, or all fail.
            denoisers = {n: self.hooks[n] for n in self.denoisers}
            if _parallel_session is None:
                raise BCGError("parallel= needs accel.parallel, which was not imported")
            self.parallel = _parallel_session(pipe, denoisers, self.guard, options)
        if options.cfg_batch:
            self._apply_cfg_batch()

    @property
    def primary(self) -> torch.nn.Module:
        """The first denoiser."""
        return getattr(self.pipe, self.denoisers[0])

    def pool_for(self, device: torch.device) -> GraphPool | None:
        """This pipeline's graph pool on ``device`` (None off CUDA): one pool per pipeline."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self._own_pool is None or self._own_pool.device.index != index:
            self._own_pool = GraphPool(device)
        return self._own_pool

    def why_no_graphs(self, device: torch.device) -> str | None:
        """Why nothing can be captured on ``device``, or None."""
        if not torch.cuda.is_available():
            return "CUDA is not available (graphs need a CUDA device)"
        if device.type != "cuda":
            return f"the denoiser is on {device}, not a CUDA device"
        reasons = {h.inactive_reason for h in self.hooks.values() if not h.active}
        if reasons and not any(h.active for h in self.hooks.values()):
            return "; ".join(sorted(r for r in reasons if r))
        return None

    def _follow_weights(self) -> None:
        # Per call, from the scheduler's set_timesteps: the denoisers. Components check
        # themselves as they are called (text encoders run before set_timesteps).
        for name in self.denoisers:
            self.hooks[name].follow_weights()
        if self.quantization is not None:
            self.quantization.note_call()

    def _apply_cfg_batch(self) -> None:
        # Only where graphs run (CUDA, not eager mode): elsewhere the pipeline stays unchanged.
        # Under "cfg" layouts each rank computes one branch whole: nothing to join.
        if self.guard is None or self.options.mode == "eager" or not torch.cuda.is_available():
            return
        layout = self.parallel.layout if self.parallel is not None else None
        if layout is not None and layout.cfg > 1:
            return
        degree = layout.ulysses if layout is not None else 1
        for name in self.denoisers:
            module, hook = getattr(self.pipe, name), self.hooks[name]
            if module_device(module).type != "cuda" or not hook.active:
                continue
            if hook.recipe.cfg_parallel_support(module) is not None:
                continue  # the pipeline batches its branches itself (or the recipe does not know)
            caches = hook.caches
            self.cfg_batch[name] = apply_cfg_batch(
                module,
                hook.recipe,
                self.guard,
                name=name,
                user=self,
                degree=degree,
                # Step caches keep their state per guidance branch: the branches stay apart.
                paused=(lambda c=caches: c.present) if caches is not None else None,
            )

    def uninstall(self) -> None:
        """Take out everything, in the reverse order; the pipeline is as it was before, but for
        layers ``quantize=`` put in float8, which stay (see :mod:`accel.hooks.quantize`)."""
        if self.quantization is not None:
            self.quantization.let_go()
        for name in list(self.cfg_batch):
            remove_cfg_batch(getattr(self.pipe, name), self)
        self.cfg_batch.clear()
        if self.parallel is not None:
            self.parallel.restore()
            self.parallel = None
        if self.guard is not None:
            for name in self.denoisers:
                caches = self.hooks[name].caches
                if caches is not None:
                    self.guard.unlisten(caches)
            self.guard.detach(self)
            self.guard = None
        for name in reversed(list(self.hooks)):
            module = component(self.pipe, name)
            if module is not None:
                remove_graph_runner(module, self)
        self.hooks.clear()
        self.denoisers.clear()
