"""accelerate_pipeline(pipe): put graph runners into a diffusers pipeline's denoisers.

The walker finds every denoiser (``transformer``, ``transformer_2``, ``unet``), picks the recipe
for its class, and installs a runner in the module's forward through diffusers' own hook
registry, so the module stays the module: ``.config``, ``.dtype``, ``cache_context`` and other
hooks keep working, and :meth:`PipelineAccelerator.restore` gives the pipeline back exactly as
it was. Everything outside the denoiser (text encoders, noise, scheduler steps, guidance, VAE)
stays eager.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Sequence

import torch

from . import bcg
from .pool import GraphPool
from .recipe import Recipe, recipe_for, version_supported
from .runner import GraphRunner, RunnerStats, capture_session
from .safety import RequestLock, offload_reason, shadow_method, unwrap_method, weights_fingerprint, wrap_method

__all__ = ["accelerate_pipeline", "PipelineAccelerator", "WarmupReport", "WarmupRow", "MODES", "DENOISER_NAMES"]

logger = logging.getLogger(__name__)

MODES = ("bcg", "debug", "eager")
DENOISER_NAMES = ("transformer", "transformer_2", "unet")
HOOK_NAME = "bcg_graph_runner"
# Both latent dimensions are divided by the VAE factor (8) and then patchified by 2.
RESOLUTION_MULTIPLE = 16


@dataclasses.dataclass
class WarmupRow:
    """What warming up one resolution cost."""

    width: int
    height: int
    seconds: float
    captures: int
    resident_bytes: int


@dataclasses.dataclass
class WarmupReport:
    """Per-resolution warm-up cost, largest resolution first."""

    rows: list[WarmupRow]

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def total_captures(self) -> int:
        return sum(r.captures for r in self.rows)

    @property
    def total_resident_bytes(self) -> int:
        return sum(r.resident_bytes for r in self.rows)

    def __str__(self) -> str:
        lines = [f"{'resolution':>12} {'seconds':>8} {'graphs':>6} {'graph MiB':>10}"]
        for r in self.rows:
            lines.append(f"{r.width:>5}x{r.height:<6} {r.seconds:8.2f} {r.captures:6d} {r.resident_bytes / 2**20:10.1f}")
        lines.append(
            f"{'total':>12} {self.total_seconds:8.2f} {self.total_captures:6d} {self.total_resident_bytes / 2**20:10.1f}"
        )
        return "\n".join(lines)


def _hook_classes() -> tuple[type, type]:
    from diffusers.hooks import HookRegistry, ModelHook

    class GraphHook(ModelHook):
        """Routes the module's forward through a recipe's call normalisation and a runner."""

        def __init__(self, recipe: Recipe | None, runner: GraphRunner) -> None:
            super().__init__()
            self.recipe = recipe
            self.runner = runner

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            # Normalising calls (padding) only serves graph sharing: where nothing can be
            # captured the stock call runs untouched, so CPU results equal eager exactly.
            if self.recipe is not None and self.runner.enabled and _module_device(module).type == "cuda":
                args, kwargs = self.recipe.prepare(args, kwargs)
            return self.runner(*args, **kwargs)

    return HookRegistry, GraphHook


@dataclasses.dataclass
class _Denoiser:
    name: str
    module: torch.nn.Module
    recipe: Recipe
    runner: GraphRunner
    undo_recipe: Any
    had_forward_attr: bool
    had_registry: bool
    active: bool  # the recipe is installed and graphs may be used (not eager mode, known version)
    fingerprint: int | None = None
    offloaded: str | None = None


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class PipelineAccelerator:
    """Attached to a pipeline as ``pipe.accel`` by :func:`accelerate_pipeline`."""

    def __init__(
        self,
        pipe: Any,
        *,
        mode: str,
        runner_options: dict[str, Any],
        recipe_options: dict[str, Any],
    ) -> None:
        self.pipe = pipe
        self.mode = mode
        self.options = {**runner_options, **recipe_options}
        self.pool: GraphPool | None = None
        self._denoisers: dict[str, _Denoiser] = {}
        self._shadowed: list[tuple[Any, str, Any]] = []
        self.request_lock = RequestLock()
        HookRegistry, GraphHook = _hook_classes()
        try:
            for name in DENOISER_NAMES:
                module = getattr(pipe, name, None)
                if isinstance(module, torch.nn.Module):
                    self._install(name, module, HookRegistry, GraphHook, recipe_options)
            if not self._denoisers:
                raise ValueError(
                    f"{type(pipe).__name__} has no denoiser to accelerate (looked for components named "
                    f"{', '.join(DENOISER_NAMES)})"
                )
            self._wrap_pipeline_calls()
        except BaseException:
            self._uninstall()
            raise

    # ---------------------------------------------------------------------------------------
    # Installation
    # ---------------------------------------------------------------------------------------
    def _install(self, name: str, module: torch.nn.Module, HookRegistry: type, GraphHook: type, opts: dict) -> None:
        recipe_cls = recipe_for(module)
        recipe = recipe_cls(**opts)
        ok, installed = version_supported(recipe_cls)
        runner = GraphRunner(
            module.forward,
            name=name,
            pool=self._pool_for(module),
            capture_on_miss=self.options["capture_on_miss"],
            max_entries=self.options["max_entries"],
            max_segments=self.options["max_segments"],
            debug=self.mode == "debug",
            capture_scope=lambda: recipe.capture_scope(module),
            memory_budget=None if self.options["memory_budget_mb"] is None else int(self.options["memory_budget_mb"] * 2**20),
        )
        undo = lambda: None  # noqa: E731
        if self.mode == "eager":
            runner.enabled = False
        elif not ok:
            logger.warning(
                "%s: the %s recipe was tested with diffusers %s, this is %s; running %s eagerly",
                name,
                recipe.name,
                recipe.diffusers_versions,
                installed,
                type(module).__name__,
            )
            runner.enabled = False
        else:
            undo = recipe.install(module)
        had_forward_attr = "forward" in module.__dict__
        had_registry = hasattr(module, "_diffusers_hook")
        registry = HookRegistry.check_if_exists_or_initialize(module)
        hook = GraphHook(recipe if runner.enabled else None, runner)
        registry.register_hook(hook, HOOK_NAME)
        original = hook.fn_ref.original_forward
        runner.fn = recipe.wrap_forward(original) if runner.enabled else original
        d = _Denoiser(name, module, recipe, runner, undo, had_forward_attr, had_registry, active=runner.enabled)
        self._denoisers[name] = d
        self._check(d)
        logger.info("%s: %s with the %s recipe, mode %s", name, type(module).__name__, recipe.name, self.mode)

    def _pool_for(self, module: torch.nn.Module) -> GraphPool | None:
        device = _module_device(module)
        if device.type != "cuda":
            return None
        if self.pool is None or self.pool.device != device:
            self.pool = GraphPool(device)
        return self.pool

    def _wrap_pipeline_calls(self) -> None:
        scheduler = getattr(self.pipe, "scheduler", None)
        # The scheduler indexes its sigmas with a Python int that advances every step: inside a
        # graph that would freeze one step. It runs outside the denoiser anyway; marking it eager
        # keeps it eager even if someone captures a larger region.
        if hasattr(scheduler, "step"):
            make = lambda step: bcg.eager_on_graph(step, name="scheduler.step")  # noqa: E731
            self._shadowed.append((scheduler, "step", shadow_method(scheduler, "step", make)))
        # A pipeline call starts by setting the scheduler's timesteps and ends by freeing model
        # hooks: there, once per call, calls are serialised and weights and offload are checked.
        if hasattr(scheduler, "set_timesteps"):
            previous = wrap_method(scheduler, "set_timesteps", before=self._begin_call)
            self._shadowed.append((scheduler, "set_timesteps", previous))
        if hasattr(self.pipe, "maybe_free_model_hooks"):
            previous = wrap_method(self.pipe, "maybe_free_model_hooks", after=self.request_lock.end)
            self._shadowed.append((self.pipe, "maybe_free_model_hooks", previous))

    def _begin_call(self) -> None:
        self.request_lock.begin()
        for d in self._denoisers.values():
            self._check(d)

    def _check(self, d: _Denoiser) -> None:
        """Stop graphs from replaying weights that moved or changed since they were captured."""
        if not d.active:
            return
        reason = offload_reason(d.module)
        if reason is not None:
            if d.offloaded is None:
                d.offloaded = reason
                d.runner.release()
                d.runner.enabled = False
                logger.warning(
                    "%s: %s move the weights between calls, so graphs would read stale memory; running "
                    "eagerly while offloading is on",
                    d.name,
                    reason,
                )
            return
        if d.offloaded is not None:
            logger.info("%s: offloading is off again; graphs are used from the next warm-up", d.name)
            d.offloaded = None
            d.runner.enabled = True
            d.fingerprint = None
        fingerprint = weights_fingerprint(d.module)
        if d.fingerprint is not None and fingerprint != d.fingerprint:
            dropped = d.runner.invalidate()
            if dropped:
                logger.warning(
                    "%s: weights changed since capture (LoRA, load_state_dict, a move or a cast); dropped %d "
                    "graphs, each is captured again on its next call",
                    d.name,
                    dropped,
                )
        d.fingerprint = fingerprint

    def _uninstall(self) -> None:
        for d in reversed(list(self._denoisers.values())):
            d.runner.release()
            registry = getattr(d.module, "_diffusers_hook", None)
            if registry is not None:
                registry.remove_hook(HOOK_NAME, recurse=False)
                if not d.had_registry and not registry.hooks:
                    del d.module._diffusers_hook
            if not d.had_forward_attr:
                d.module.__dict__.pop("forward", None)
            d.undo_recipe()
        self._denoisers.clear()
        for obj, name, previous in reversed(self._shadowed):
            unwrap_method(obj, name, previous)
        self._shadowed.clear()

    # ---------------------------------------------------------------------------------------
    # Public surface
    # ---------------------------------------------------------------------------------------
    @property
    def runners(self) -> dict[str, GraphRunner]:
        """The runner of each denoiser, by component name."""
        return {name: d.runner for name, d in self._denoisers.items()}

    @property
    def recipes(self) -> dict[str, Recipe]:
        return {name: d.recipe for name, d in self._denoisers.items()}

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
            A :class:`WarmupReport` with seconds, graphs and resident graph memory per resolution.
        """
        res = _normalise_resolutions(resolutions)
        cfgs = (cfg,) if isinstance(cfg, bool) else tuple(dict.fromkeys(bool(c) for c in cfg))
        sizes = sorted({int(b) for b in batch_sizes}, reverse=True)
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
        if num_inference_steps < 2:
            raise ValueError("num_inference_steps must be at least 2 (one-step schedules can be degenerate)")
        if prompts is not None and prompt_lengths is not None:
            raise ValueError("pass prompts or prompt_lengths, not both")
        primary = next(iter(self._denoisers.values()))
        recipe = primary.recipe
        if prompts is not None:
            lengths = recipe.prompt_lengths(self.pipe, list(prompts))
        elif prompt_lengths is not None:
            lengths = [int(n) for n in prompt_lengths]
            if any(n < 1 for n in lengths):
                raise ValueError(f"prompt_lengths must be positive, got {lengths}")
        else:
            lengths = list(recipe.default_prompt_lengths())
        try:
            negative_length = recipe.prompt_lengths(self.pipe, [negative_prompt or ""])[0]
        except NotImplementedError:
            negative_length = min(lengths)
        lengths = sorted({recipe.warmup_length(n) for n in lengths}, reverse=True)

        capturing = [d.runner for d in self._denoisers.values() if d.runner.enabled]
        device = _module_device(primary.module)
        if not capturing or device.type != "cuda" or not torch.cuda.is_available():
            logger.info("warmup: nothing to capture (mode %s, denoiser on %s)", self.mode, device)
            return WarmupReport([WarmupRow(w, h, 0.0, 0, 0) for w, h in res])
        pool = self._pool_for(primary.module)
        for r in capturing:
            if r.pool is None:
                r.pool = pool

        cases = [(w, h, b, c, n) for (w, h) in res for b in sizes for c in sorted(cfgs, reverse=True) for n in lengths]
        rows: dict[tuple[int, int], WarmupRow] = {}
        progress_config = dict(getattr(self.pipe, "_progress_bar_config", {}))
        self.pipe.set_progress_bar_config(disable=True)
        bar = _progress(len(cases), enabled=progress)
        try:
            with capture_session(), _all_capturing(capturing):
                for w, h, b, c, n in cases:
                    row = rows.setdefault((w, h), WarmupRow(w, h, 0.0, 0, 0))
                    captures0 = sum(r.stats(memory=False).captures for r in capturing)
                    resident0 = pool.resident_bytes()
                    t0 = time.perf_counter()
                    generator = torch.Generator(device).manual_seed(0)
                    for kwargs in recipe.warmup_calls(
                        self.pipe,
                        width=w,
                        height=h,
                        batch_size=b,
                        cfg=c,
                        prompt_length=n,
                        negative_prompt_length=negative_length,
                        num_inference_steps=num_inference_steps,
                    ):
                        self.pipe(**kwargs, generator=generator)
                    torch.cuda.synchronize(device)
                    row.seconds += time.perf_counter() - t0
                    row.captures += sum(r.stats(memory=False).captures for r in capturing) - captures0
                    row.resident_bytes += pool.resident_bytes() - resident0
                    bar.set_postfix_str(f"{w}x{h} batch {b} cfg {c} text {n}")
                    bar.update()
        finally:
            bar.close()
            self.pipe._progress_bar_config = progress_config
        for d in self._denoisers.values():
            self._check(d)
        report = WarmupReport(list(rows.values()))
        failures = {name: d.runner.blocked for name, d in self._denoisers.items() if d.runner.blocked}
        for name, blocked in failures.items():
            for reason in set(blocked.values()):
                logger.warning("%s: a warm-up capture failed and runs eagerly: %s", name, reason)
        logger.info("warmup done:\n%s", report)
        return report

    def stats(self) -> dict[str, RunnerStats]:
        """Counters of each denoiser's runner, by component name."""
        return {name: d.runner.stats() for name, d in self._denoisers.items()}

    def graph_memory_bytes(self) -> int:
        """Device memory held for graphs: the shared pool, static inputs and boundary buffers."""
        stats = [d.runner.stats() for d in self._denoisers.values()]
        pool = self.pool.resident_bytes() if self.pool is not None else 0
        return pool + sum(s.static_bytes + s.boundary_bytes for s in stats)

    def report(self) -> str:
        """A human-readable summary of modes, recipes, counters and graph memory."""
        lines = [f"bcg-diffusers: {type(self.pipe).__name__}, mode {self.mode}"]
        for name, d in self._denoisers.items():
            s = d.runner.stats()
            state = "graphs" if d.runner.enabled else "eager"
            lines.append(
                f"  {name} ({type(d.module).__name__}, recipe {d.recipe.name}, {state}): "
                f"{s.entries} graphs, {s.captures} captures in {s.capture_seconds:.2f}s, {s.replays} replays, "
                f"{s.misses} misses, {s.eager_calls} eager calls, {s.capture_failures} capture failures, "
                f"{s.evictions} evictions, segments per graph {s.segments_per_entry or '-'}"
            )
            for reason in sorted(set(d.runner.blocked.values())):
                lines.append(f"    capture failed: {reason}")
        lines.append(f"  graph memory: {self.graph_memory_bytes() / 2**20:.1f} MiB")
        return "\n".join(lines)

    def release(self) -> None:
        """Drop every captured graph and give the graph memory back to torch.

        Graphs are captured again by the next warm-up (or on first use, if enabled).
        """
        for d in self._denoisers.values():
            d.runner.release()
        if torch.cuda.is_available():
            # The pool's memory returns to the device once no graph uses it.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def restore(self) -> Any:
        """Put the pipeline back exactly as it was before :func:`accelerate_pipeline`."""
        self._uninstall()
        if self.pipe.__dict__.get("accel") is self:
            del self.pipe.__dict__["accel"]
        self.pool = None
        return self.pipe


class _all_capturing:
    """Enter ``capturing()`` of several runners at once."""

    def __init__(self, runners: list[GraphRunner]) -> None:
        self.contexts = [r.capturing() for r in runners]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="capturing graphs", unit="case", disable=not enabled, leave=False)


def _normalise_resolutions(resolutions: Any) -> list[tuple[int, int]]:
    if isinstance(resolutions, tuple) and len(resolutions) == 2 and all(isinstance(v, int) for v in resolutions):
        resolutions = [resolutions]
    out: list[tuple[int, int]] = []
    for r in resolutions:
        try:
            w, h = (int(v) for v in r)
        except (TypeError, ValueError):
            raise ValueError(f"a resolution is a (width, height) pair of integers, got {r!r}") from None
        if w <= 0 or h <= 0 or w % RESOLUTION_MULTIPLE or h % RESOLUTION_MULTIPLE:
            raise ValueError(
                f"resolution {w}x{h} cannot be generated: width and height must be positive multiples of "
                f"{RESOLUTION_MULTIPLE}"
            )
        out.append((w, h))
    if not out:
        raise ValueError("no resolutions given")
    # Largest first: smaller captures then reuse the pool blocks the largest one reserved.
    return sorted(dict.fromkeys(out), key=lambda wh: wh[0] * wh[1], reverse=True)


def accelerate_pipeline(
    pipe: Any,
    *,
    mode: str = "bcg",
    capture_on_miss: bool = False,
    text_buckets: Sequence[int] | None | str = "default",
    max_entries: int = 32,
    max_segments: int = 512,
    memory_budget_mb: float | None = None,
) -> Any:
    """Make ``pipe``'s denoising loop replay CUDA graphs; returns ``pipe`` with ``pipe.accel``.

    Args:
        pipe: a diffusers pipeline (``DiffusionPipeline``); its denoisers are found by name.
        mode: ``"bcg"`` (graphs), ``"debug"`` (each denoiser call runs eagerly as one break
            through the same runner) or ``"eager"`` (attached but never captures).
        capture_on_miss: capture a new signature on first use instead of running it eagerly.
        text_buckets: text lengths prompts are padded to (masked) where the recipe supports it,
            so prompts of different lengths share a graph; ``None`` disables padding.
        max_entries: graphs kept per denoiser (least recently used evicted beyond).
        max_segments: a capture with more segments than this runs eagerly instead.
        memory_budget_mb: graph memory beyond which further captures are refused (they run
            eagerly, with a message); None for no limit.

    Calling it again with the same options is harmless; other options re-install.
    """
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"accelerate_pipeline expects a diffusers DiffusionPipeline, got {type(pipe).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    runner_options = dict(
        capture_on_miss=capture_on_miss,
        max_entries=max_entries,
        max_segments=max_segments,
        memory_budget_mb=memory_budget_mb,
    )
    recipe_options: dict[str, Any] = {}
    if text_buckets != "default":
        recipe_options["text_buckets"] = None if text_buckets is None else tuple(sorted(int(b) for b in text_buckets))
    existing = pipe.__dict__.get("accel")
    if isinstance(existing, PipelineAccelerator):
        if existing.mode == mode and existing.options == {**runner_options, **recipe_options}:
            return pipe
        existing.restore()
    accel = PipelineAccelerator(pipe, mode=mode, runner_options=runner_options, recipe_options=recipe_options)
    # Set through __dict__: DiffusionPipeline.__setattr__ would try to register it as a component.
    pipe.__dict__["accel"] = accel
    return pipe
