"""accelerate_pipeline(pipe): put graph runners into a diffusers pipeline's modules.

The walker finds every denoiser (``transformer``, ``transformer_2``, ``unet``) and, as
components, the text encoders and the VAE's decoder, and applies a
:class:`~accel.hooks.graph_hook.GraphHook` to each (one per module, shared by every pipeline that uses the
module); all of a pipeline's graphs share one pool, so the decode's activations reuse the
denoiser's. A :class:`~accel.hooks.guard.CallGuard` on the scheduler serialises calls and checks the
denoisers' weights once per call (components check theirs as they are called);
:mod:`accel.hooks.warmup` plans and runs the captures. Noise, scheduler steps, guidance and
post-processing stay eager. With ``parallel=`` one image is computed by several processes
(:mod:`accel.parallel`); each rank runs the components (which hold no collectives) with its own
graphs.
:meth:`PipelineAccelerator.restore` gives the pipeline back exactly as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ..graphs.pool import GraphPool
from ..graphs.runner import GraphRunner, RunnerStats
from .cfg_batch import CFGBatchHook, apply_cfg_batch, remove_cfg_batch
from .graph_hook import HOOK_NAME, GraphHook, apply_graph_runner, module_device, release_graph_runner
from .guard import CallGuard
from .options import (
    DEFAULT_PARALLEL_TIMEOUT_S,
    MODES,
    RECIPE_DEFAULT,
    RESOLUTION_MULTIPLE,
    AcceleratorOptions,
    RecipeDefault,
)
from .recipe import Recipe
from .safety import RequestLock
from .warmup import WarmupReport, WarmupRow, plan_warmup, run_warmup

__all__ = [
    "DENOISER_NAMES",
    "HOOK_NAME",
    "MODES",
    "RESOLUTION_MULTIPLE",
    "PipelineAccelerator",
    "WarmupReport",
    "WarmupRow",
    "accelerate_pipeline",
]

logger = logging.getLogger(__name__)

DENOISER_NAMES = ("transformer", "transformer_2", "unet")
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
VAE_DECODER = "vae.decoder"


def _component(pipe: Any, name: str) -> torch.nn.Module | None:
    """The module at a dotted component path (``"vae.decoder"``), if there is one."""
    obj = pipe
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.nn.Module) else None


def _components(pipe: Any, options: AcceleratorOptions) -> list[str]:
    """Names of the non-denoiser modules that get graphs under ``options``."""
    names = list(TEXT_ENCODER_NAMES) if options.text_encoder else []
    if options.vae:
        names.append(VAE_DECODER)
    return [n for n in names if _component(pipe, n) is not None]


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
    """Attached to a pipeline as ``pipe.accel`` by :func:`accelerate_pipeline`."""

    def __init__(self, pipe: Any, options: AcceleratorOptions) -> None:
        self.pipe = pipe
        self.options = options
        # Denoisers first, then components (text encoders, the VAE decoder).
        self._hooks: dict[str, GraphHook] = {}
        self._denoisers: list[str] = []
        self._guard: CallGuard | None = None
        self._parallel: ParallelSession | None = None
        self._cfg_batch: dict[str, CFGBatchHook] = {}
        self._own_pool: GraphPool | None = None
        self._restored = False
        try:
            for name in DENOISER_NAMES:
                module = getattr(pipe, name, None)
                if isinstance(module, torch.nn.Module):
                    pool = self._pool_for(module_device(module))
                    self._hooks[name] = apply_graph_runner(module, options, name=name, user=self, pool=pool)
                    self._denoisers.append(name)
            if not self._hooks:
                raise ValueError(
                    f"{type(pipe).__name__} has no denoiser to accelerate (looked for components named "
                    f"{', '.join(DENOISER_NAMES)})"
                )
            known = self._hooks[self._denoisers[0]].recipe.component_breaks()
            for name in _components(pipe, options):
                module = _component(pipe, name)
                assert module is not None
                self._hooks[name] = apply_graph_runner(
                    module,
                    options,
                    name=name,
                    user=self,
                    pool=self._pool_for(module_device(module)),
                    component=True,
                    breaks=known.get(name, ()),
                    offload_root=_component(pipe, name.split(".")[0]),
                )
            self._guard = CallGuard.attach(pipe, self, self._follow_weights)
            if self._guard is not None:
                for name in self._denoisers:
                    hook = self._hooks[name]
                    if hook.caches is not None:
                        self._guard.listen(hook.caches, begin=hook.new_call, end=hook.caches.end_call)
            if options.parallel is not None:
                # Collective: every rank of the launch builds its session here, or all fail.
                denoisers = {n: self._hooks[n] for n in self._denoisers}
                if _parallel_session is None:
                    raise RuntimeError("parallel= needs accel.parallel, which was not imported")
                self._parallel = _parallel_session(pipe, denoisers, self._guard, options)
            if options.cfg_batch:
                self._apply_cfg_batch()
        except BaseException:
            self._uninstall()
            raise
        device = module_device(self._primary_module)
        if options.mode != "eager" and (device.type != "cuda" or not torch.cuda.is_available()):
            _say_no_cuda_once(device)

    # ---------------------------------------------------------------------------------------
    # Installation
    # ---------------------------------------------------------------------------------------
    @property
    def _primary_module(self) -> torch.nn.Module:
        return getattr(self.pipe, self._denoisers[0])

    def _follow_weights(self) -> None:
        # Per call, from the scheduler's set_timesteps: the denoisers. Components check
        # themselves as they are called (text encoders run before set_timesteps).
        for name in self._denoisers:
            self._hooks[name].follow_weights()

    def _apply_cfg_batch(self) -> None:
        # Only where graphs run (CUDA, not eager mode): elsewhere the pipeline stays unchanged.
        # Under "cfg" layouts each rank computes one branch whole: nothing to join.
        if self._guard is None or self.options.mode == "eager" or not torch.cuda.is_available():
            return
        layout = self._parallel.layout if self._parallel is not None else None
        if layout is not None and layout.cfg > 1:
            return
        degree = layout.ulysses if layout is not None else 1
        for name in self._denoisers:
            module, hook = getattr(self.pipe, name), self._hooks[name]
            if module_device(module).type != "cuda" or not hook.active:
                continue
            if hook.recipe.cfg_parallel_support(module) is not None:
                continue  # the pipeline batches its branches itself (or the recipe does not know)
            caches = hook.caches
            self._cfg_batch[name] = apply_cfg_batch(
                module,
                hook.recipe,
                self._guard,
                name=name,
                user=self,
                degree=degree,
                # Step caches keep their state per guidance branch: the branches stay apart.
                paused=(lambda c=caches: c.present) if caches is not None else None,
            )

    def _uninstall(self) -> None:
        for name in list(self._cfg_batch):
            remove_cfg_batch(getattr(self.pipe, name), self)
        self._cfg_batch.clear()
        if self._parallel is not None:
            self._parallel.restore()
            self._parallel = None
        if self._guard is not None:
            for name in self._denoisers:
                caches = self._hooks[name].caches
                if caches is not None:
                    self._guard.unlisten(caches)
            self._guard.detach(self)
            self._guard = None
        for name in reversed(list(self._hooks)):
            module = _component(self.pipe, name)
            if module is not None:
                release_graph_runner(module, self)
        self._hooks.clear()
        self._denoisers.clear()

    # ---------------------------------------------------------------------------------------
    # Public surface
    # ---------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def parallel(self) -> ParallelSession | None:
        """The several-process session (its ``layout``, ``rank``, counters), or None."""
        return self._parallel

    @property
    def runners(self) -> dict[str, GraphRunner]:
        """The runner of each denoiser and component (``text_encoder``, ``vae.decoder``), by
        component name (shared with other pipelines that use the same module)."""
        return {name: h.runner for name, h in self._hooks.items()}

    @property
    def recipes(self) -> dict[str, Recipe]:
        """The recipe of each denoiser."""
        return {name: self._hooks[name].recipe for name in self._denoisers}

    @property
    def pool(self) -> GraphPool | None:
        """The graph memory pool this pipeline's graphs live in (None before any CUDA use).

        One pool per pipeline: every signature of every denoiser overlays its intermediates in
        it (only one graph replays at a time), and :meth:`release` gives all of it back without
        depending on other pipelines. A denoiser shared with a pipeline accelerated earlier keeps
        that pipeline's pool.
        """
        return next((h.runner.pool for h in self._hooks.values() if h.runner.pool is not None), None)

    @property
    def found_breaks(self) -> dict[str, list[Any]]:
        """Where captures failed on operations a graph cannot hold, by component: each a
        :class:`~accel.graphs.discover.BreakSite` (function, file, line, error)."""
        return {name: list(h.runner.found_breaks) for name, h in self._hooks.items() if h.runner.found_breaks}

    def _pool_for(self, device: torch.device) -> GraphPool | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self._own_pool is None or self._own_pool.device.index != index:
            self._own_pool = GraphPool(device)
        return self._own_pool

    @property
    def request_lock(self) -> RequestLock | None:
        """The lock that serialises this pipeline's calls (shared with pipelines that share its
        scheduler); None where the pipeline has no scheduler to hook."""
        return self._guard.lock if self._guard is not None else None

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
        progress: bool = True,
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
            progress: show a progress bar.

        Returns:
            A :class:`WarmupReport` with capture seconds (and compile seconds with
            ``compile=True``), graphs and resident graph memory per resolution; its ``skipped``
            says why nothing was captured, where nothing was.
        """
        self._require_installed()
        primary = self._hooks[self._denoisers[0]]
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
        )
        if self._parallel is not None:
            # Every rank must capture the same cases in the same order.
            self._parallel.check_same("the warm-up plan", [repr(plan)])
        runners = [h.runner for h in self._hooks.values() if h.active]
        device = module_device(self._primary_module)
        skipped = self._why_no_graphs(device) if not runners or device.type != "cuda" else None
        if skipped is not None:
            logger.warning("warmup: nothing to capture: %s", skipped)
            return WarmupReport([WarmupRow(w, h, 0.0, 0, 0) for w, h in plan.resolutions], skipped=skipped)
        for r in runners:
            if r.pool is None:  # the module reached the GPU after accelerate_pipeline
                r.pool = self._pool_for(device)
        compiled = any(h.compiled for h in self._hooks.values())
        components = [h.runner for n, h in self._hooks.items() if n not in self._denoisers and h.active]
        with contextlib.ExitStack() as forcing:
            for name in self._denoisers:
                caches = self._hooks[name].caches
                if caches is not None and caches.active:
                    forcing.enter_context(caches.forcing())
            report = run_warmup(
                self.pipe,
                primary.recipe,
                plan,
                runners,
                device,
                compiled=compiled,
                progress=progress,
                prompts=list(prompts) if prompts else None,
                negative_prompt=negative_prompt,
                components=components,
            )
        for hook in self._hooks.values():
            hook.follow_weights()
        for name, hook in self._hooks.items():
            for reason in set(hook.runner.blocked.values()):
                logger.warning("%s: a warm-up capture failed and runs eagerly: %s", name, reason)
        logger.info("warmup done:\n%s", report)
        return report

    def _why_no_graphs(self, device: torch.device) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available (graphs need a CUDA device)"
        if device.type != "cuda":
            return f"the denoiser is on {device}, not a CUDA device"
        reasons = {h.inactive_reason for h in self._hooks.values() if not h.active}
        if reasons and not any(h.active for h in self._hooks.values()):
            return "; ".join(sorted(r for r in reasons if r))
        return None

    def stats(self) -> dict[str, RunnerStats]:
        """Counters of each denoiser's runner, by component name."""
        return {name: h.runner.stats() for name, h in self._hooks.items()}

    def guidance_batches(self) -> dict[str, tuple[int, int]]:
        """Per denoiser whose guidance branches may be joined (``cfg_batch``): (pairs run as one
        batched call, first branches run alone)."""
        return {name: (b.joined, b.alone) for name, b in self._cfg_batch.items()}

    def graph_memory_bytes(self) -> int:
        """Device memory held for graphs: the graph pool(s), static inputs and boundary buffers."""
        stats = [h.runner.stats() for h in self._hooks.values()]
        pools = {id(h.runner.pool): h.runner.pool for h in self._hooks.values() if h.runner.pool is not None}
        return sum(p.resident_bytes() for p in pools.values()) + sum(s.static_bytes + s.boundary_bytes for s in stats)

    def report(self) -> str:
        """A human-readable summary of modes, recipes, counters, graph memory and, where no
        graph exists, why."""
        lines = [f"bcg-diffusers: {type(self.pipe).__name__}, mode {self.mode}"]
        if self._restored:
            return lines[0] + ": restored (not accelerated any more)"
        device = module_device(self._primary_module)
        for name, h in self._hooks.items():
            s = h.runner.stats()
            state = "graphs" if h.active else f"eager ({h.inactive_reason})"
            extra = ", compiled blocks" if h.compiled else ""
            if h.recompile_drops:
                extra += f", graphs dropped by {h.recompile_drops} recompiles"
            lines.append(
                f"  {name} ({type(_component(self.pipe, name)).__name__}, recipe {h.recipe.name}, {state}{extra}): "
                f"{s.entries} graphs, {s.captures} captures in {s.capture_seconds:.2f}s, {s.replays} replays, "
                f"{s.misses} misses, {s.eager_calls} eager calls, {s.capture_failures} capture failures, "
                f"{s.evictions} evictions, segments per graph {s.segments_per_entry or '-'}"
            )
            for reason in sorted(set(h.runner.blocked.values())):
                lines.append(f"    capture failed: {reason}")
            for site in h.runner.found_breaks:
                lines.append(f"    capture broke at: {site}")
            if h.caches is not None and h.caches.active:
                for line in h.caches.describe():
                    lines.append(f"    step cache, last call: {line}")
                paths = [p for entry in s.paths_per_entry for p in entry]
                lines.append(
                    f"    decision paths with graphs: {', '.join(sorted(set(paths))) or 'none yet'}; "
                    f"{s.path_captures} captured on the way, {s.path_misses} taken without a graph, "
                    f"{s.path_switches} chain switches"
                )
            if name in self._cfg_batch:
                joined, alone = self.guidance_batches()[name]
                lines.append(f"    guidance branches: {joined} pairs run as one batch, {alone} calls alone")
            if not s.entries and h.active:
                why = self._why_no_graphs(device) or (
                    "nothing warmed up yet: call pipe.accel.warmup(...) or pass capture_on_miss=True"
                )
                lines.append(f"    no graphs: {why}")
        if self._parallel is not None:
            lines.append(f"  {self._parallel.describe()}")
        lines.append(f"  graph memory: {self.graph_memory_bytes() / 2**20:.1f} MiB")
        return "\n".join(lines)

    def release(self) -> None:
        """Drop every captured graph and give the graph memory back to torch.

        Graphs are captured again by the next warm-up (or on first use, if enabled).
        """
        for h in self._hooks.values():
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
        if self._restored:
            return self.pipe
        self._uninstall()
        self._restored = True
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
        parallel = self._parallel
        self.release()
        self.restore()
        if parallel is not None:
            parallel.shutdown()
        return self.pipe

    def _require_installed(self) -> None:
        if self._restored:
            raise RuntimeError("this accelerator was restored; call accelerate_pipeline(pipe) again to use graphs")


def accelerate_pipeline(
    pipe: Any,
    *,
    mode: str = "bcg",
    capture_on_miss: bool = False,
    text_buckets: Sequence[int] | RecipeDefault | None = RECIPE_DEFAULT,
    max_entries: int = 32,
    max_segments: int = 512,
    memory_budget_mb: float | None = None,
    compile: bool = False,
    compile_cache_dir: str | Path | None = None,
    parallel: str | None = None,
    parallel_timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S,
    text_encoder: bool = True,
    vae: bool = True,
    auto_breaks: bool = False,
    cfg_batch: bool = True,
) -> Any:
    """Make ``pipe``'s denoising loop replay CUDA graphs; returns ``pipe`` with ``pipe.accel``.

    Args:
        pipe: a diffusers pipeline (``DiffusionPipeline``); its denoisers are found by name.
            Pipelines sharing a denoiser module (built from one another's components) share
            its graphs.
        mode: ``"bcg"`` (graphs), ``"debug"`` (each denoiser call runs eagerly as one break
            through the same runner) or ``"eager"`` (attached but never captures).
        capture_on_miss: capture a new signature on first use instead of running it eagerly.
        text_buckets: text lengths prompts are padded to (masked) where the recipe pads text,
            so prompts of different lengths share a graph; ``None`` disables padding; by default
            the recipe's own buckets.
        max_entries: graphs kept per denoiser (least recently used evicted beyond).
        max_segments: a capture with more segments than this runs eagerly instead.
        memory_budget_mb: graph memory beyond which further captures are refused (they run
            eagerly, with a message); None for no limit.
        compile: compile the denoiser's repeated blocks with inductor (dynamic shapes, compiled
            once for every resolution) and capture the graphs over the compiled kernels. Needs
            CUDA; elsewhere it is skipped with one message.
        compile_cache_dir: where compiled kernels persist between processes; default
            ``$BCG_COMPILE_CACHE`` or ``~/.cache/bcg-diffusers/compile``. Delete it to clear.
        parallel: one image on every process of a ``torchrun`` / ``accelerate launch`` (each with
            its pipeline on its own GPU, all making the same calls with the same seed): ``"cfg"``
            (2 processes: the two guidance branches, one per GPU, bit-identical to one GPU;
            pipelines that batch their branches into one call, like Z-Image's, are refused),
            ``"ulysses"`` (diffusers' Ulysses context parallelism over all processes) or
            ``"cfg+ulysses"`` (2 x N/2 processes, N >= 4). Every rank returns the same image.
            Collective: every process must call this with the same options. The process group is
            created if none exists. See :mod:`accel.parallel`.
        parallel_timeout_s: how long a rank waits for the others (a dead or diverging rank)
            before it fails with an error instead of hanging; also the process group's timeout
            when this call creates it.
        text_encoder: graphs for the text encoders too (``text_encoder``, ``text_encoder_2``,
            ``text_encoder_3``), one per token length, captured by :meth:`PipelineAccelerator.warmup`
            from the prompts it is given (or on first use with ``capture_on_miss``). Embeddings
            stay bit-identical to eager: nothing is padded. With ``parallel=`` every rank runs its
            own (they hold no collectives).
        vae: graphs for the VAE's decoder, one per latent shape, captured by the warm-up in the
            same memory pool as the denoiser's graphs, so the decode's activations reuse the
            pool instead of adding to it. With ``parallel=`` every rank decodes with its own.
        auto_breaks: when a capture fails on an operation a graph cannot hold (a host sync, a
            data-dependent shape), run the function that did it as an eager break and capture
            again; the graph is kept only if it equals an eager run bit for bit. Off: the failure
            is named (function, file and line) in :meth:`PipelineAccelerator.report`. Marks only
            functions that are pure functions of their inputs safely; the equality check is
            the guard.
        cfg_batch: where a pipeline calls the denoiser once per guidance branch (Qwen-Image's
            true CFG) and the recipe finds it pays (Qwen-Image: up to 768x768 on one GPU, where
            it pads text anyway; up to 1024x1024 under ``parallel="ulysses"`` on 2 ranks), run
            the two as one call at twice the batch (CUDA only; not under ``"cfg"`` layouts,
            which put the branches on different ranks; see :mod:`accel.hooks.cfg_batch`). Off: one
            call each.

    Raises:
        TypeError: ``pipe`` is not a diffusers pipeline.
        ValueError: an option is invalid, the pipeline has no denoiser, or a denoiser is
            already accelerated by another pipeline with other options.
        accel.parallel.ParallelConfigError: (a ValueError) with ``parallel=``, raised on every
            rank alike: the launch, the model or another rank's options do not fit.

    Calling it again with the same options is harmless; other options re-install.
    """
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"accelerate_pipeline expects a diffusers DiffusionPipeline, got {type(pipe).__name__}")
    options = AcceleratorOptions(
        mode=mode,  # type: ignore[arg-type]
        capture_on_miss=capture_on_miss,
        text_buckets=text_buckets,  # type: ignore[arg-type]
        max_entries=max_entries,
        max_segments=max_segments,
        memory_budget_mb=memory_budget_mb,
        compile=compile,
        compile_cache_dir=Path(compile_cache_dir) if compile_cache_dir is not None else None,
        parallel=parallel,  # type: ignore[arg-type]
        parallel_timeout_s=parallel_timeout_s,
        text_encoder=text_encoder,
        vae=vae,
        auto_breaks=auto_breaks,
        cfg_batch=cfg_batch,
    )
    existing = pipe.__dict__.get("accel")
    if isinstance(existing, PipelineAccelerator):
        if existing.options == options:
            return pipe
        existing.restore()
    accel = PipelineAccelerator(pipe, options)
    # Set through __dict__: DiffusionPipeline.__setattr__ would try to register it as a component.
    pipe.__dict__["accel"] = accel
    return pipe
