"""The variants of scripts/bench_caches.py: a step cache (cache-dit's DBCache, diffusers'
FirstBlockCache or TaylorSeer) with and without graphs, or with cache-dit's own compile, on one
pipeline; each call timed end to end, each denoiser call by CUDA events, its distance to eager."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch

from .calls import timed_call, warm_up
from .rows import failed
from .settings import call_kwargs, res_name
from .settings import say_clock as say

CACHES = ("dbcache", "fbc", "taylorseer")


def parse_variant(name: str) -> tuple[str | None, str]:
    """``"dbcache+bcg-compile"`` -> ``("dbcache", "bcg-compile")``; ``"eager"`` -> ``(None, "eager")``."""
    cache, _, mode = name.partition("+")
    if cache in ("eager", "bcg", "bcg-compile"):
        return None, cache
    if cache.endswith("-compile") and not mode:
        return cache[: -len("-compile")], "own-compile"
    if cache not in CACHES or mode not in ("", "bcg", "bcg-compile"):
        raise argparse.ArgumentTypeError(f"unknown variant {name!r}")
    return cache, mode or "eager"


def dbcache_config(model: str, threshold: float) -> Any:
    """cache-dit's DBCache as the benchmarks run it on ``model``: the first block computed, a
    longer warm-up and no cap on cached steps for Qwen-Image, ``threshold`` the residual's."""
    import cache_dit

    qwen = model == "qwen-image"
    return cache_dit.DBCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=8 if qwen else 4,
        max_continuous_cached_steps=3,
        max_cached_steps=-1 if qwen else 3,
        residual_diff_threshold=threshold,
    )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from pipelines.builders import build_pipeline

        self.args = args
        self.cuda = torch.cuda.is_available() and args.size == "full"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        say(f"building {args.model} ({args.size}) on {self.device}")
        self.pipe = build_pipeline(args.model, args.size, device=self.device, dtype=dtype, seed=0)
        self.pipe.set_progress_bar_config(disable=True)
        self.steps = args.steps or (20 if args.model == "qwen-image" else 9)
        self.refs: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}
        self.call_times: list[tuple[float, bool | None]] = []

    # -- caches, the way their libraries document ----------------------------------------------
    def enable(self, cache: str) -> None:
        pipe, t = self.pipe, self.pipe.transformer
        if cache == "dbcache":
            import cache_dit

            cache_dit.enable_cache(pipe, cache_config=dbcache_config(self.args.model, self.args.dbcache_threshold))
        else:
            from diffusers.hooks import (
                FirstBlockCacheConfig,
                HookRegistry,
                TaylorSeerCacheConfig,
                apply_first_block_cache,
                apply_taylorseer_cache,
            )

            if cache == "fbc":
                config, apply = FirstBlockCacheConfig(threshold=self.args.fbc_threshold), apply_first_block_cache
            else:
                ids = [r"^layers\.\d+\.attention$"] if self.args.model == "z-image" else None
                config = TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, cache_identifiers=ids)
                apply = apply_taylorseer_cache
            if hasattr(t, "enable_cache"):  # CacheMixin (Qwen-Image); Z-Image has none in diffusers 0.42
                t.enable_cache(config)
            else:
                apply(t, config)
                HookRegistry.check_if_exists_or_initialize(t).invalidate_child_registries_cache()

    def disable(self, cache: str) -> None:
        if cache == "dbcache":
            import cache_dit

            cache_dit.disable_cache(self.pipe)
            return
        if hasattr(self.pipe.transformer, "disable_cache"):
            self.pipe.transformer.disable_cache()
            return
        from diffusers.hooks import HookRegistry

        for m in self.pipe.transformer.modules():
            registry = vars(m).get("_diffusers_hook")
            if registry is not None:
                for name in list(registry.hooks):
                    if not name.startswith("bcg_"):
                        registry.remove_hook(name, recurse=False)
        HookRegistry.check_if_exists_or_initialize(self.pipe.transformer).invalidate_child_registries_cache()

    # -- one call, timed -------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def generate(self, wh: tuple[int, int]) -> tuple[float, torch.Tensor]:
        seconds, latents, _ = timed_call(self.pipe, call_kwargs(self.args.model, wh, self.steps), self.steps,
                                         self.device, self.sync)  # fmt: skip
        return seconds, latents

    @contextlib.contextmanager
    def timed_calls(self, counts: Any) -> Any:
        """CUDA events around every denoiser call; each call marked cached or computed from the
        step cache's counters."""
        self.call_times = []
        if not self.cuda:
            yield
            return
        pending: list[Any] = []

        def pre(module: Any, args: Any, kwargs: Any) -> None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            pending.append((start, None if counts is None else counts.total_steps[1]))

        def post(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            start, cached_before = pending.pop()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            cached = None if counts is None else counts.total_steps[1] > cached_before
            self.call_times.append((start, end, cached))

        t = self.pipe.transformer
        handles = [t.register_forward_pre_hook(pre, with_kwargs=True), t.register_forward_hook(post, with_kwargs=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def step_ms(self) -> dict[str, float | None]:
        self.sync()
        times: dict[bool | None, list[float]] = {True: [], False: [], None: []}
        for start, end, cached in self.call_times:
            times[cached].append(start.elapsed_time(end))
        med = {k: (round(statistics.median(v), 2) if v else None) for k, v in times.items()}
        return {"computed": med[False] if med[False] is not None else med[None], "cached": med[True]}

    # -- one variant -----------------------------------------------------------------------------
    def run(self, variant: str, wh: tuple[int, int]) -> dict[str, Any]:
        from accel import accelerate_pipeline

        cache, mode = parse_variant(variant)
        row: dict[str, Any] = {"variant": variant, "resolution": res_name(wh)}
        if cache is not None:
            self.enable(cache)
        try:
            setup = 0.0
            if mode in ("bcg", "bcg-compile"):
                t0 = time.perf_counter()
                accelerate_pipeline(self.pipe, compile=mode == "bcg-compile")
                cfg = self.args.model == "qwen-image"
                report = warm_up(self.pipe, [wh], cfg, steps=max(2, self.args.warmup_steps))
                setup = time.perf_counter() - t0
                row.update(warmup_s=round(report.total_seconds, 2), compile_s=round(report.total_compile_seconds, 2))
            elif cache in ("fbc", "taylorseer") and not hasattr(self.pipe.transformer, "enable_cache"):
                # diffusers' caches need a cache context and a reset per call, which only CacheMixin
                # denoisers' pipelines give them; without graphs, the library gives them that alone.
                accelerate_pipeline(self.pipe, mode="eager")
            elif mode == "own-compile":
                import cache_dit

                cache_dit.set_compile_configs()
                self.pipe.transformer.compile_repeated_blocks(fullgraph=False)
            t0 = time.perf_counter()
            first, _ = self.generate(wh)  # untimed: compiles, captures what the warm-up left
            row["first_call_s"] = round(first, 2)
            if mode == "own-compile":
                setup = time.perf_counter() - t0
            row["setup_s"] = round(setup, 2)
            counts = self._counts()
            seconds, latents = [], None
            for i in range(self.args.runs):
                ctx = self.timed_calls(counts) if i == self.args.runs - 1 else contextlib.nullcontext()
                with ctx:
                    s, latents = self.generate(wh)
                seconds.append(s)
            row["seconds"] = round(statistics.median(seconds), 3)
            if counts is not None:
                row["cached"] = f"{counts.steps[1]} of {counts.steps[0] + counts.steps[1]} calls"
                row["step_ms"] = self.step_ms()
                st = self.pipe.accel.stats()["transformer"]
                row["paths"] = st.paths_per_entry
                row["eager_calls"] = st.eager_calls
            row.update(self._diff(cache, mode, wh, latents))
            row["status"] = "ok"
        except Exception as exc:
            failed(row, exc)
        finally:
            if "accel" in self.pipe.__dict__:
                self.pipe.accel.restore()
            if cache is not None:
                with contextlib.suppress(Exception):
                    self.disable(cache)
            if mode == "own-compile":
                for m in self.pipe.transformer.modules():
                    m._compiled_call_impl = None
            if self.cuda:
                torch.cuda.empty_cache()
        say(f"{variant} {res_name(wh)}: {json.dumps({k: v for k, v in row.items() if k != 'variant'})}")
        return row

    def _counts(self) -> Any:
        accel = self.pipe.__dict__.get("accel")
        hook = accel.hooks.get("transformer") if accel is not None else None
        caches = hook.caches if hook is not None else None
        return caches.rules[0].counts if caches is not None and caches.rules else None

    def _diff(self, cache: str | None, mode: str, wh: tuple[int, int], latents: torch.Tensor) -> dict[str, Any]:
        key = (cache or "none", wh)
        if mode == "eager":
            self.refs[key] = latents
        out: dict[str, Any] = {}
        ref = self.refs.get(key)
        if mode != "eager" and ref is not None and "compile" not in mode:
            out["diff"] = rel(latents, ref)
        if mode == "bcg-compile":  # against the same compiled, cached pipeline without graphs
            runner = self.pipe.accel.runners["transformer"]
            runner.enabled = False
            try:
                _, plain = self.generate(wh)
            finally:
                runner.enabled = True
            out["diff_vs_compiled_eager"] = rel(latents, plain)
            if ref is not None:
                out["diff_vs_eager"] = rel(latents, ref)
        if mode == "own-compile" and ref is not None:
            out["diff_vs_eager"] = rel(latents, ref)
        return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    return float(f"{((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item():.3g}")
