"""``pipe.accel``: the accelerator of one pipeline (:func:`accelerate_pipeline` attaches it).

:func:`accelerate_pipeline` plans the install in one pass (:mod:`accel.hooks.plan`), puts the
plan in, layer by layer (:mod:`accel.hooks.install`), and attaches the accelerator.
:class:`PipelineAccelerator` is a facade over what was installed:
it warms the graphs up (:mod:`accel.hooks.warmup_plan` plans the captures,
:mod:`accel.hooks.warmup` runs them), reports
(:mod:`accel.hooks.report`), releases graph memory, and restores the pipeline exactly as it was.
Noise, scheduler steps, guidance and post-processing stay eager; ``output_type="pil"``'s pixels
are made on the device (:mod:`accel.hooks.images`), diffusers' own bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..graphs.errors import BCGError
from ..graphs.pool import GraphPool
from ..graphs.runner import GraphRunner, RunnerStats
from .compiled.compile import compile_options
from .components import DENOISER_NAMES, VAE_DECODER, module_device
from .fp8.quantize import Quantization
from .graph_hook import HOOK_NAME, GraphHook
from .images.decoder_trial import NOT_KEPT
from .install import Installation, ParallelSession, register_parallel_session
from .options import MODES, RESOLUTION_MULTIPLE, AcceleratorOptions, with_overrides
from .plan import InstallPlan, plan_install
from .recipes.recipe import Recipe
from .report import WarmupReport, WarmupRow, graph_memory_bytes, report
from .state.guard import CallGuard, RequestLock
from .warmup import run_warmup, uncaptured
from .warmup_plan import case_calls, plan_warmup

__all__ = [
    "DENOISER_NAMES",
    "HOOK_NAME",
    "MODES",
    "RESOLUTION_MULTIPLE",
    "PipelineAccelerator",
    "WarmupReport",
    "WarmupRow",
    "accelerate_pipeline",
    "register_parallel_session",
]

logger = logging.getLogger(__name__)

_said_no_cuda = False


def _say_no_cuda_once(device: torch.device) -> None:
    # Said once per process, at WARNING: an INFO line a user never sees would leave them
    # wondering why nothing got faster.
    global _said_no_cuda
    if not _said_no_cuda:
        _said_no_cuda = True
        why = "CUDA is not available" if not torch.cuda.is_available() else f"the denoiser is on {device}"
        logger.warning("bcg-diffusers: CUDA graphs are off (%s); the pipeline runs eagerly, unchanged", why)


class PipelineAccelerator:
    """Attached to a pipeline as ``pipe.accel`` by :func:`accelerate_pipeline`.

    Lifecycle verbs: :meth:`warmup` captures graphs, :meth:`release` drops them (and gives their
    memory back), :meth:`restore` takes everything out of the pipeline, :meth:`shutdown` restores
    and, with ``parallel=``, leaves the process group.
    """

    def __init__(self, pipe: Any, installed: Installation) -> None:
        self.pipe = pipe
        self.options = installed.options
        self._installed: Installation | None = installed
        self._graph_memory: tuple[Any, int] | None = None  # (what the graphs were, their bytes)

    @property
    def installed(self) -> Installation:
        """What was installed; RuntimeError once restored."""
        if self._installed is None:
            raise BCGError("this accelerator was restored; call accelerate_pipeline(pipe) again to use graphs")
        return self._installed

    @property
    def plan(self) -> InstallPlan | None:
        """What :func:`accelerate_pipeline` planned and installed (None once restored)."""
        return self._installed.plan if self._installed is not None else None

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def hooks(self) -> dict[str, GraphHook]:
        """The graph hook of each accelerated module, denoisers first, by component name."""
        return self._installed.hooks if self._installed is not None else {}

    @property
    def guard(self) -> CallGuard | None:
        """The scheduler's call guard (None where the pipeline has no scheduler to hook)."""
        return self._installed.guard if self._installed is not None else None

    @property
    def parallel(self) -> ParallelSession | None:
        """The several-process session (its ``layout``, ``rank``, counters), or None."""
        return self._installed.parallel if self._installed is not None else None

    @property
    def runners(self) -> dict[str, GraphRunner]:
        """The runner of each denoiser and component (``text_encoder``, ``vae.decoder``), by
        component name (shared with other pipelines that use the same module)."""
        return {name: h.runner for name, h in self.hooks.items()}

    @property
    def recipes(self) -> dict[str, Recipe]:
        """The recipe of each denoiser."""
        installed = self._installed
        return {name: installed.hooks[name].recipe for name in installed.denoisers} if installed else {}

    @property
    def pool(self) -> GraphPool | None:
        """The graph memory pool this pipeline's graphs live in (None before any CUDA use).

        One pool per pipeline: every signature of every denoiser overlays its intermediates in
        it (only one graph replays at a time), and :meth:`release` gives all of it back without
        depending on other pipelines. A denoiser shared with a pipeline accelerated earlier keeps
        that pipeline's pool.
        """
        return next((h.runner.pool for h in self.hooks.values() if h.runner.pool is not None), None)

    @property
    def found_breaks(self) -> dict[str, list[Any]]:
        """Where captures failed on operations a graph cannot hold, by component: each a
        :class:`~accel.graphs.discover.BreakSite` (function, file, line, error)."""
        return {name: list(h.runner.found_breaks) for name, h in self.hooks.items() if h.runner.found_breaks}

    @property
    def request_lock(self) -> RequestLock | None:
        """The lock that serialises this pipeline's calls (shared with pipelines that share its
        scheduler); None where the pipeline has no scheduler to hook."""
        return self.guard.lock if self.guard is not None else None

    def stats(self, memory: bool = True) -> dict[str, RunnerStats]:
        """Counters of each runner (denoisers, then components), by component name. ``memory``
        adds byte counts, which read the allocator's snapshot (milliseconds on a large pool):
        pass False where counters are read around every call."""
        return {name: h.runner.stats(memory) for name, h in self.hooks.items()}

    def guidance_batches(self) -> dict[str, tuple[int, int]]:
        """Per denoiser whose guidance branches may be joined (``cfg_batch``): (pairs run as one
        batched call, first branches run alone)."""
        batches = self._installed.cfg_batch if self._installed is not None else {}
        return {name: (b.joined, b.alone) for name, b in batches.items()}

    @property
    def quantization(self) -> Quantization | None:
        """What ``quantize=`` did to the denoisers (:meth:`Quantization.summary` says it in one
        line), or None where nothing is quantized."""
        return self._installed.quantization if self._installed is not None else None

    def graph_memory_bytes(self) -> int:
        """Device memory held for graphs: the graph pool(s), static inputs and boundary buffers.

        Read again only after a graph was captured, failed, evicted or released: the pool's bytes
        come from the allocator's snapshot (milliseconds on gigabytes of graphs), and a server's
        admission asks before every call, while replays change none of it."""
        hooks = self.hooks
        state = (
            id(self._installed),
            tuple(_graph_counts(h.runner.stats(memory=False, pool=False)) for h in hooks.values()),
        )
        if self._graph_memory is None or self._graph_memory[0] != state:
            self._graph_memory = (state, graph_memory_bytes(hooks))
        return self._graph_memory[1]

    def report(self) -> str:
        """A human-readable summary of modes, recipes, counters, graph memory, the patches in
        place and, where no graph exists, why."""
        return report(self._installed, type(self.pipe).__name__, self.mode)

    def warmup(
        self,
        resolutions: tuple[int, int] | Iterable[tuple[int, int]],
        *,
        batch_sizes: Sequence[int] = (1,),
        cfg: bool | Sequence[bool] = True,
        prompt_lengths: Sequence[int] | None = None,
        prompts: Sequence[str] | None = None,
        negative_prompt: str | None = None,
        num_inference_steps: int = 2,
        num_frames: int | Sequence[int] | None = None,
        call_kwargs: Mapping[str, Any] | None = None,
        progress: bool = True,
        measure_cfg: bool | None = None,
    ) -> WarmupReport:
        """Capture every signature that calls at these settings will hit, largest first.

        Args:
            resolutions: ``(width, height)`` or a list of them; multiples of 16.
            batch_sizes: images per call to capture for.
            cfg: whether calls use classifier-free guidance (``True``, ``False`` or both).
            prompt_lengths: text lengths in tokens to capture for (after the model's template).
            prompts: real prompts whose lengths to capture for (instead of ``prompt_lengths``).
            negative_prompt: the negative prompt real calls will use (its length matters).
            num_inference_steps: steps of each warm-up call (>= 2; graphs do not depend on it).
            num_frames: frame counts to capture for a video pipeline (one whose call takes
                ``num_frames``); None: its call's default. A ValueError for an image pipeline.
            call_kwargs: extra pipeline arguments every warm-up call passes, as real calls do
                (``prompt_embeds``/``negative_prompt_embeds`` for a pipeline built without text
                encoders, an ``image`` for an edit pipeline, ``max_sequence_length``); a key the
                call does not take, or one the warm-up sets itself (``width``, ``prompt``,
                ``guidance_scale``, ...), is a ValueError.
            progress: show a progress bar.
            measure_cfg: with ``quantize=``, the guidance setting of the call the first warm-up
                measures (one of ``cfg``): that of the calls the pipeline will mostly make.
                None: where ``cfg`` has both, the one the recipe's usual call runs (Z-Image:
                off; Qwen-Image: on), else ``cfg``'s. Guidance multiplies the float8 error into
                the latents, so a selection measured with it keeps far more layers in bf16.

        Returns:
            A :class:`WarmupReport` with capture seconds (and compile seconds with
            ``compile=True``), graphs and resident graph memory per resolution; its ``skipped``
            says why nothing was captured, where nothing was.

        With ``quantize=``, the first warm-up first measures one call (the largest case with the
        guidance setting ``measure_cfg``) in bf16 and quantized, and quantizes the layers it
        selects (:mod:`accel.hooks.fp8.quantize`).
        """
        installed = self.installed
        hooks, denoisers = installed.hooks, installed.denoisers
        primary = hooks[denoisers[0]]
        plan = plan_warmup(
            primary.recipe,
            self.pipe,
            resolutions,
            batch_sizes=batch_sizes,
            cfg=cfg,
            prompt_lengths=prompt_lengths,
            prompts=prompts,
            negative_prompt=negative_prompt,
            num_inference_steps=num_inference_steps,
            num_frames=num_frames,
            call_kwargs=call_kwargs,
            measure_cfg=measure_cfg,
        )
        if installed.parallel is not None:
            # Every rank must capture the same cases in the same order.
            installed.parallel.check_same("the warm-up plan", [repr(plan)])
        if installed.quantization is not None and installed.quantization.pending:
            case = plan.measured_case
            guidance = "guidance on" if case.cfg else "guidance off"
            installed.quantization.calibrate(
                self.pipe,
                next(iter(case_calls(primary.recipe, self.pipe, case))),
                module_device(installed.primary),
                keep={name: hooks[name].recipe.fp8_keep for name in denoisers},
                where=f"{case.width}x{case.height}, batch {case.batch_size}, {guidance}, {case.num_inference_steps} steps",
                paused=uncaptured(h.runner for h in hooks.values()),
            )
        runners = [h.runner for h in hooks.values() if h.active]
        device = module_device(installed.primary)
        skipped = installed.why_no_graphs(device) if not runners or device.type != "cuda" else None
        if skipped is not None:
            logger.warning("warmup: nothing to capture: %s", skipped)
            return WarmupReport([WarmupRow(w, h, 0.0, 0, 0, frames=f) for w, h, f in plan.sizes], skipped=skipped)
        for r in runners:
            if r.pool is None:  # the module reached the GPU after accelerate_pipeline
                r.pool = installed.pool_for(device)
        compiled = any(h.compiled for h in hooks.values())
        components = [h.runner for n, h in hooks.items() if n not in denoisers and h.active]
        decoder = hooks.get(VAE_DECODER)
        with contextlib.ExitStack() as forcing:
            for name in denoisers:
                caches = hooks[name].caches
                if caches is not None and caches.active:
                    forcing.enter_context(caches.forcing())
            result = run_warmup(
                self.pipe,
                primary.recipe,
                plan,
                runners,
                device,
                compiled=compiled,
                progress=progress,
                prompts=([prompts] if isinstance(prompts, str) else list(prompts)) if prompts else None,
                negative_prompt=negative_prompt,
                components=components,
                decoder=(VAE_DECODER, decoder.runner) if decoder is not None and decoder.active else None,
                decided=[r.decoder for w in installed.warmups for r in w.rows if r.decoder is not None],
                earlier=installed.warmup_plans,
            )
        installed.warmups.append(result)
        installed.warmup_plans.append(plan)
        for hook in hooks.values():
            hook.follow_weights()
        for name, hook in hooks.items():
            for reason in set(hook.runner.blocked.values()):
                if not reason.startswith(NOT_KEPT):
                    logger.warning("%s: a warm-up capture failed and runs eagerly: %s", name, reason)
        logger.info("warmup done:\n%s", result)
        return result

    def release(self) -> None:
        """Drop every captured graph and give the graph memory back to torch.

        Graphs are captured again by the next warm-up (or on first use, if enabled).
        """
        for h in self.hooks.values():
            h.runner.release()
        if torch.cuda.is_available():
            # The pool's memory returns to the device once no graph uses it.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def restore(self) -> Any:
        """Put the pipeline back as it was before :func:`accelerate_pipeline`.

        A denoiser shared with another accelerated pipeline stays accelerated for that one; the
        last pipeline to restore puts the module back exactly as it was. Restoring twice is
        harmless.
        """
        if self._installed is None:
            return self.pipe
        self._installed.uninstall()
        self._installed = None
        if self.pipe.__dict__.get("accel") is self:
            del self.pipe.__dict__["accel"]
        return self.pipe

    def shutdown(self) -> Any:
        """Restore the pipeline and, with ``parallel=``, leave the process group cleanly.

        Graphs holding collectives are released before the process group goes (a process group
        destroyed under live graphs can hang the exit); the process group is destroyed if
        ``accelerate_pipeline`` created it. Exiting the process does the same by itself (an
        ``atexit`` handler); call this to end a several-GPU run earlier.
        """
        parallel = self.parallel
        self.release()
        self.restore()
        if parallel is not None:
            parallel.shutdown()
        return self.pipe


def accelerate_pipeline(pipe: Any, options: AcceleratorOptions | None = None, **overrides: Any) -> Any:
    """Make ``pipe``'s denoising loop replay CUDA graphs; returns ``pipe`` with ``pipe.accel``.

    Args:
        pipe: a diffusers pipeline (``DiffusionPipeline``); its denoisers are found by name.
            Pipelines sharing a denoiser module (built from one another's components) share
            its graphs.
        options: an :class:`~accel.hooks.options.AcceleratorOptions` (each field is documented
            there); None for the defaults.
        overrides: fields of the options, by name, in place of ``options``' own
            (``accelerate_pipeline(pipe, mode="debug", capture_on_miss=True)``).

    Raises:
        TypeError: ``pipe`` is not a diffusers pipeline, or an override names no field (the
            message lists them).
        ValueError: an option is invalid, the pipeline has no denoiser, or a denoiser is
            already accelerated by another pipeline with other options.
        accel.ParallelConfigError: (a ValueError) with ``parallel``, raised on every rank alike:
            the launch, the model or another rank's options do not fit.

    Calling it again with the same options is harmless; other options re-install.
    """
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"accelerate_pipeline expects a diffusers DiffusionPipeline, got {type(pipe).__name__}")
    options = with_overrides(options, overrides)
    if options.compile:
        compile_options(options.inductor)  # an unknown inductor setting fails before anything is installed
    existing = pipe.__dict__.get("accel")
    if isinstance(existing, PipelineAccelerator):
        if existing.options == options:
            return pipe
        existing.restore()
    plan = plan_install(pipe, options)  # refuses in one line what cannot be; nothing is installed yet
    installed = Installation(pipe, plan)  # each layer once, in the plan's order (restore(): reversed)
    device = module_device(installed.primary)
    if options.mode != "eager" and (device.type != "cuda" or not torch.cuda.is_available()):
        _say_no_cuda_once(device)
    # Set through __dict__: DiffusionPipeline.__setattr__ would try to register it as a component.
    pipe.__dict__["accel"] = PipelineAccelerator(pipe, installed)
    return pipe


def _graph_counts(s: RunnerStats) -> tuple[int, ...]:
    """What changes whenever a runner's graphs, and so the memory they hold, change."""
    return (s.captures, s.path_captures, s.capture_failures, s.evictions, s.entries, sum(s.segments_per_entry))
