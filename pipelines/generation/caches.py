"""``--cache``: a step cache on the denoiser, applied the way its library documents it.

fbc, taylorseer and magcache are diffusers' hooks (``diffusers.hooks.apply_*``), dbcache is
cache-dit's ``enable_cache`` (an optional extra). The preparation applies them before
``accelerate_pipeline`` and records what it applied; how a cache behaves under graphs is the
library's business.

The knobs are checked with the rest of the input, before anything is built: a knob the method
does not take, or one without ``--cache``, is an error rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from .errors import GenerationError, InputError, RunError, one_line
from .extras import install_command, missing

logger = logging.getLogger(__name__)

# Which knob each method takes, by flag.
_FLAGS = {"threshold": "--cache-threshold", "interval": "--cache-interval", "ratios": "--cache-ratios"}
KNOBS: dict[str, tuple[str, ...]] = {
    "fbc": ("threshold",),
    "taylorseer": ("interval",),
    "magcache": ("threshold", "ratios"),
    "dbcache": ("threshold",),
}
# Z-Image-style transformers name their attention modules layers.N.attention, which none of
# TaylorSeer's default patterns (blocks / transformer_blocks ... attn) match.
LAYERS_ATTENTION = r"^layers\.\d+\.attention$"
CACHE_DIT_EXTRA = install_command("cache-dit")
# The built-in models on which a cache of diffusers' cannot run, by method, and why: the help
# says so from here, check_supported refuses them before the build, and
# tests/pipelines/cli/test_help_claims.py checks the two agree for every model and method.
NOT_ON: dict[str, tuple[tuple[str, ...], str]] = {
    "taylorseer": (("wan", "wan-1.3b"), "it finds no attention module it knows there"),
}


def support_text() -> str:
    """What the help says of which built-in model takes which of diffusers' caches."""
    refusals = [f"{method} on {' and '.join(models)} ({why})" for method, (models, why) in NOT_ON.items()]
    # z-image included: its denoiser has no CacheMixin, but accelerate_pipeline opens the caches'
    # context for it.
    hooks = ", ".join(m for m in KNOBS if CacheRequest(m).diffusers_hook)
    text = f"diffusers' caches ({hooks}) run on every built-in model, z-image included"
    return f"{text}, except {'; '.join(refusals)}" if refusals else text


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """What ``--cache`` and its knobs asked for; ``None`` knobs take the method's default."""

    method: str
    threshold: float | None = None
    interval: int | None = None
    ratios: tuple[float, ...] | None = None

    @property
    def diffusers_hook(self) -> bool:
        """fbc, taylorseer and magcache are diffusers' hooks; dbcache is cache-dit."""
        return self.method != "dbcache"


def cache_request(method: str | None, threshold: float | None, interval: int | None,
                  ratios: Iterable[float] | None) -> CacheRequest | None:  # fmt: skip
    """The request of ``--cache`` and its knobs, or InputError for knobs that do not fit."""
    given = {k: v for k, v in (("threshold", threshold), ("interval", interval), ("ratios", ratios)) if v is not None}
    if method is None:
        if given:
            flags = " and ".join(_FLAGS[k] for k in given)
            raise InputError(f"{flags} tune a step cache, which this run does not use: add --cache "
                           f"{'|'.join(KNOBS)}")  # fmt: skip
        return None
    for knob in given:
        if knob not in KNOBS[method]:
            takes = " and ".join(_FLAGS[k] for k in KNOBS[method])
            raise InputError(f"--cache {method} takes no {_FLAGS[knob]} (its knob: {takes})")
    if method == "magcache" and ratios is None:
        raise InputError(
            "--cache magcache needs --cache-ratios R1,R2,...: MagCache skips steps by magnitude ratios calibrated "
            "for each model (diffusers' MagCacheConfig(calibrate=True) prints them)"
        )
    if method == "dbcache" and missing("cache-dit"):
        raise InputError(f"--cache dbcache uses cache-dit, which is not installed: {CACHE_DIT_EXTRA}")
    return CacheRequest(method, threshold, interval, tuple(ratios) if ratios is not None else None)


def denoiser_of(pipe: Any) -> Any:
    """The pipeline's denoiser module (``transformer`` or ``unet``), or None."""
    for name in ("transformer", "unet"):
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    return None


def _taylorseer_defaults() -> tuple[str, ...]:
    from diffusers.hooks import taylorseer_cache

    # The patterns TaylorSeer hooks when given none (private in diffusers, so read defensively).
    return tuple(getattr(taylorseer_cache, "_TRANSFORMER_BLOCK_IDENTIFIERS", ()))


def taylorseer_identifiers(denoiser: Any) -> list[str] | None:
    """``cache_identifiers`` for TaylorSeer: None where its defaults match ``denoiser``'s modules."""
    names = [name for name, _ in denoiser.named_modules()]
    defaults = _taylorseer_defaults()
    if not defaults or any(re.fullmatch(p, n) for p in defaults for n in names):
        return None
    if any(re.fullmatch(LAYERS_ATTENTION, n) for n in names):
        return [LAYERS_ATTENTION]
    return None


def check_supported(request: CacheRequest, denoiser: Any, pipeline: str) -> None:
    """InputError where ``request`` cannot work on ``denoiser`` (a module, perhaps on the meta device).

    diffusers' caches keep their state per ``cache_context``, which pipelines of ``CacheMixin``
    models open around every denoiser call; for a denoiser without one (Z-Image in diffusers
    0.42), ``accelerate_pipeline`` opens it (the preparation always calls it, in every mode). TaylorSeer
    also needs modules its patterns match.
    """
    if not request.diffusers_hook or denoiser is None:
        return
    if request.method == "taylorseer":
        patterns = taylorseer_identifiers(denoiser) or list(_taylorseer_defaults())
        names = [name for name, _ in denoiser.named_modules()]
        if patterns and not any(re.fullmatch(p, n) for p in patterns for n in names):
            raise InputError(f"--cache taylorseer finds no attention module of {type(denoiser).__name__} to cache")


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _describe(method: str, config: Any, keys: Iterable[str]) -> str:
    return f"{method} " + " ".join(f"{k}={_fmt(getattr(config, k))}" for k in keys)


def _block_count(denoiser: Any) -> int | None:
    import torch

    lengths = [len(m) for _, m in denoiser.named_children() if isinstance(m, torch.nn.ModuleList)]
    return max(lengths) if lengths else None


def apply_cache(pipe: Any, request: CacheRequest, steps: int) -> str:
    """Turn ``request``'s cache on in ``pipe``; returns what was applied, for the PNG text."""
    denoiser = denoiser_of(pipe)
    if denoiser is None:
        raise InputError(f"--cache {request.method}: {type(pipe).__name__} has no transformer or unet to cache")
    try:
        return _apply(pipe, denoiser, request, steps)
    except GenerationError:
        raise
    except Exception as e:  # the libraries refuse models they cannot hook in many ways
        raise RunError(f"--cache {request.method} cannot be applied to {type(denoiser).__name__}: "
                       f"{one_line(e)[:300]}") from None  # fmt: skip


def _apply(pipe: Any, denoiser: Any, request: CacheRequest, steps: int) -> str:
    if request.method == "fbc":
        from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

        config = FirstBlockCacheConfig(**_given(threshold=request.threshold))
        apply_first_block_cache(denoiser, config)
        return _describe("fbc", config, ["threshold"])
    if request.method == "taylorseer":
        from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache

        config = TaylorSeerCacheConfig(
            **_given(cache_interval=request.interval, cache_identifiers=taylorseer_identifiers(denoiser))
        )
        apply_taylorseer_cache(denoiser, config)
        return _describe("taylorseer", config, ["cache_interval", "disable_cache_before_step", "max_order"])
    if request.method == "magcache":
        from diffusers.hooks import MagCacheConfig, apply_mag_cache

        # The ratios are per step of a schedule: diffusers resamples them to this run's steps.
        config = MagCacheConfig(mag_ratios=list(request.ratios or ()), num_inference_steps=steps,
                                **_given(threshold=request.threshold))  # fmt: skip
        apply_mag_cache(denoiser, config)
        described = _describe("magcache", config, ["threshold", "max_skip_steps", "retention_ratio"])
        return f"{described} ratios={','.join(_fmt(r) for r in request.ratios or ())}"
    return _apply_dbcache(pipe, denoiser, request)


def _given(**kwargs: Any) -> dict[str, Any]:
    """The keyword arguments that were given: the rest keep the library's documented defaults."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _apply_dbcache(pipe: Any, denoiser: Any, request: CacheRequest) -> str:
    # cache-dit logs a page of INFO to stdout, where the summary line goes; its own variable
    # quiets it unless the user set one.
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
    import cache_dit

    kwargs = _given(residual_diff_threshold=request.threshold)
    defaults = {f.name: f.default for f in dataclasses.fields(cache_dit.DBCacheConfig)}
    fn, bn = defaults.get("Fn_compute_blocks"), defaults.get("Bn_compute_blocks", 0)
    blocks = _block_count(denoiser)
    if isinstance(fn, int) and isinstance(bn, int) and blocks is not None and fn + bn >= blocks:
        # cache-dit asserts on the first step when its always-computed blocks are not fewer than
        # the model's (the tiny models have 2): leave at least one block to cache.
        kwargs["Fn_compute_blocks"] = max(1, blocks - bn - 1)
        logger.info("dbcache: %s has %d blocks, so Fn_compute_blocks is %d instead of cache-dit's default %d",
                    type(denoiser).__name__, blocks, kwargs["Fn_compute_blocks"], fn)  # fmt: skip
    config = cache_dit.DBCacheConfig(**kwargs)
    cache_dit.enable_cache(pipe, cache_config=config)
    return _describe("dbcache", config, ["residual_diff_threshold", "Fn_compute_blocks", "Bn_compute_blocks"])
