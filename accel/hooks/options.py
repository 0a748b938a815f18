"""The options of :func:`accel.accelerate_pipeline`, and the constants every layer shares.

:class:`AcceleratorOptions` is the API: what :func:`accel.accelerate_pipeline` is asked for,
validated once, frozen and comparable (calling it again with equal options is a no-op). Each
field is documented on the class. The one sentinel, :data:`RECIPE_DEFAULT`, is a typed enum
member. This file needs only the standard library: the command line reads it before torch is
imported.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, get_args

__all__ = [
    "ATTENTION_MODES",
    "MODES",
    "PARALLEL_MODES",
    "QUANTIZE_MODES",
    "RECIPE_DEFAULT",
    "RESOLUTION_MULTIPLE",
    "AcceleratorOptions",
    "Attention",
    "Mode",
    "Parallel",
    "Quantize",
    "RecipeDefault",
    "check_resolution",
    "default_compile_cache_dir",
    "parse_resolution",
    "with_overrides",
]

Mode = Literal["bcg", "debug", "eager"]
MODES: tuple[str, ...] = get_args(Mode)

# One image on several processes (accel/parallel): the guidance branches on two ranks, diffusers'
# Ulysses context parallelism over all ranks, or both (two Ulysses groups, one per branch).
Parallel = Literal["cfg", "ulysses", "cfg+ulysses"]
PARALLEL_MODES: tuple[str, ...] = get_args(Parallel)
DEFAULT_PARALLEL_TIMEOUT_S = 300.0

# The denoisers' attention on FlashAttention-3 (accel/hooks/attention): exact, not cuDNN's bits.
Attention = Literal["fa3"]
ATTENTION_MODES: tuple[str, ...] = get_args(Attention)

# Lossy, opt-in: the denoiser's Linear layers in float8 (accel/hooks/fp8/quantize.py).
Quantize = Literal["fp8"]
QUANTIZE_MODES: tuple[str, ...] = get_args(Quantize)
# The final latents' relative distance to bf16 that quantize="fp8" may cost (AcceleratorOptions.fp8_budget).
DEFAULT_FP8_BUDGET = 0.05

# Both latent dimensions are divided by the VAE factor (8) and then patchified by 2.
RESOLUTION_MULTIPLE = 16

COMPILE_CACHE_ENV = "BCG_COMPILE_CACHE"


class RecipeDefault(enum.Enum):
    """Marks an option whose value the model's recipe chooses."""

    RECIPE = "recipe default"

    def __repr__(self) -> str:
        return "RECIPE_DEFAULT"


RECIPE_DEFAULT = RecipeDefault.RECIPE


def default_compile_cache_dir() -> Path:
    """Where compiled kernels persist between processes: ``$BCG_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/bcg-diffusers/compile`` (``~/.cache/bcg-diffusers/compile``)."""
    env = os.environ.get(COMPILE_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bcg-diffusers" / "compile"


def check_resolution(width: object, height: object) -> tuple[int, int]:
    """``(width, height)`` as ints, or ValueError: positive multiples of :data:`RESOLUTION_MULTIPLE`."""
    if isinstance(width, bool) or isinstance(height, bool):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}")
    try:
        w, h = int(width), int(height)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}") from None
    if (w, h) != (width, height):
        raise ValueError(f"a resolution is a (width, height) pair of integers, got {(width, height)!r}")
    if w <= 0 or h <= 0 or w % RESOLUTION_MULTIPLE or h % RESOLUTION_MULTIPLE:
        raise ValueError(
            f"resolution {w}x{h} cannot be generated: width and height must be positive multiples of "
            f"{RESOLUTION_MULTIPLE}"
        )
    return w, h


_RESOLUTION = re.compile(r"\s*([+-]?\d+)\s*[xX*]\s*([+-]?\d+)\s*")


def parse_resolution(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``, or ValueError naming the text."""
    m = _RESOLUTION.fullmatch(text)
    if not m:
        raise ValueError(f"resolution {text!r} is not WIDTHxHEIGHT (for example 512x512)")
    try:
        return check_resolution(int(m.group(1)), int(m.group(2)))
    except ValueError as e:
        raise ValueError(f"resolution {text!r}: {str(e).split(': ', 1)[-1]}") from None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _settings(name: str, value: object) -> tuple[tuple[str, object], ...]:
    """A mapping (or ``(key, value)`` pairs) of string keys to hashable values, as sorted pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]  # type: ignore[union-attr]
        for _, v in pairs:
            hash(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a mapping of setting names to plain values, got {value!r}") from None
    if any(not isinstance(k, str) or not k for k, _ in pairs) or len({k for k, _ in pairs}) != len(pairs):
        raise ValueError(f"{name} must be a mapping of distinct setting names to values, got {value!r}")
    return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class AcceleratorOptions:
    """What :func:`accel.accelerate_pipeline` applies: ``accelerate_pipeline(pipe, options)``, or
    the same fields as keywords, ``accelerate_pipeline(pipe, mode="debug")``.

    Graphs:

    Attributes:
        mode: ``"bcg"`` (graphs), ``"debug"`` (each denoiser call runs eagerly as one break
            through the same runner: tells capture bugs from model bugs) or ``"eager"`` (attached
            but never captures). Default ``"bcg"``.
        capture_on_miss: capture a new signature on first use instead of running it eagerly.
            Default off: a call nothing was warmed up for runs eagerly and says why once, so a
            capture never lands in the middle of a timed call.
        text_buckets: text lengths prompts are padded to (masked) where the recipe pads text, so
            prompts of different lengths share a graph: a sequence of positive token counts,
            stored sorted as a tuple; ``None`` disables padding (one graph per length, exact);
            default :data:`RECIPE_DEFAULT`, the recipe's own buckets.
        max_entries: graphs kept per denoiser; beyond it the least recently used is evicted.
            Default 32.
        max_segments: a capture with more segments than this runs eagerly instead. Default 512.
        memory_budget_mb: graph memory (MiB: pool, static inputs, boundary buffers) beyond which
            further captures are refused (they run eagerly, with a message); default None, no
            limit.
        auto_breaks: when a capture fails on an operation a graph cannot hold (a host sync, a
            pageable copy, a data-dependent shape), run the function that did it as an eager
            break and capture again; the graph is kept only if it equals an eager run bit for
            bit, else the signature runs eagerly and ``pipe.accel.report()`` names the function,
            file and line in one line. Default on: the equality check is the guard, so a found
            break can cost speed (one more segment) but never a different image. Off: a failed
            capture is only named, never retried.

    Components (more graphs, same pool):

    Attributes:
        text_encoder: graphs for the text encoders too (``text_encoder``, ``text_encoder_2``,
            ``text_encoder_3``), one per token length, captured by the warm-up from the prompts
            it is given (or on first use with ``capture_on_miss``). Embeddings stay
            bit-identical to eager: nothing is padded. With ``parallel`` every rank runs its own
            (they hold no collectives). Default on.
        vae: graphs for the VAE's decoder, one per latent shape, captured by the warm-up in the
            same memory pool as the denoiser's graphs, so the decode's activations reuse the
            pool instead of adding to it; kept only at the sizes where, measured at warm-up, they
            pay: faster than the eager decode beyond noise without raising the peak memory, or
            no slower and lowering it (the others decode eagerly; see
            :mod:`accel.hooks.images.decoder_verdict`). With ``parallel`` every rank decodes with
            its own. Default on.
        cfg_batch: where a pipeline calls the denoiser once per guidance branch (Qwen-Image's
            true CFG) and the recipe finds it pays (Qwen-Image: up to 768x768 on one GPU, where
            it pads text anyway; up to 1024x1024 under ``parallel="ulysses"`` on 2 ranks), run the
            two as one call at twice the batch (CUDA only; not under ``"cfg"`` layouts, which put
            the branches on different ranks; see :mod:`accel.hooks.cfg_batch`). Default on; off:
            one call each.

    Compile:

    Attributes:
        compile: compile the denoiser's repeated blocks with inductor (dynamic shapes, compiled
            once for every resolution) and capture the graphs over the compiled kernels: faster
            steps for a compile of seconds to a minute per process. Needs CUDA; elsewhere it is
            skipped with one message. Default off.
        compile_cache_dir: where compiled kernels persist between processes (a path; a string is
            taken as one); default None: ``$BCG_COMPILE_CACHE`` or
            ``~/.cache/bcg-diffusers/compile`` (:func:`default_compile_cache_dir`). Delete it to
            clear.
        compiled_forms: with ``compile``, swap in forms of the model's code that compile to
            fewer kernels before the blocks compile: diffusers' GELU(tanh) projections with the
            GELU in the matrix product's epilogue (:mod:`accel.hooks.compiled.fused`), the recipe's own
            (Qwen-Image's rotary embeddings in real arithmetic, FLUX.1's single-stream blocks
            without their concatenated copy), and the components' GroupNorms and channel RMS
            norms (a VAE decoder's) through inductor (:mod:`accel.hooks.compiled.group_norm`,
            :mod:`accel.hooks.compiled.channel_norm`). Equal in real arithmetic, not bit
            for bit to stock eager (neither is compile); graphs still equal the same compiled
            model without graphs. Default on; off: diffusers' code compiled as it is.
        inductor: inductor settings for the compiled blocks (``torch.compile``'s ``options``,
            e.g. ``{"coordinate_descent_tuning": True}``), over the library's own
            (:data:`accel.hooks.compiled.compile.INDUCTOR_OPTIONS`); a mapping of setting names to values,
            stored as sorted ``(name, value)`` pairs. Names inductor does not know raise
            ValueError when the blocks are compiled. Default None: the library's settings.

    Attention:

    Attributes:
        attention: ``"fa3"``: the denoisers' attention on FlashAttention-3 (the ``fa3-fwd``
            wheel, the ``[fa3]`` extra), through diffusers' attention dispatch, so the stock
            attention processors stay (:mod:`accel.hooks.attention`): exact attention on faster
            kernels than cuDNN's at the large sizes, not bit for bit cuDNN's (the report says
            so). Key-padding masks (padded text) are taken; other masks run diffusers' native
            attention, with one warning. Where it cannot run (no wheel, not a Hopper GPU) the
            attention stays as it was, with one warning. With ``quantize="fp8"`` the attention
            layers are float8 candidates too (float8 queries, keys and values, per-head
            scales), kept within ``fp8_budget`` like the Linear layers. Not with
            ``parallel="ulysses"``. Default None: diffusers' backend as it is.

    Quantization (lossy, opt-in):

    Attributes:
        quantize: ``"fp8"``: the denoisers' Linear layers in float8 (dynamic float8 activations
            and float8 weights with per-row scales: torchao's, through ``torchao.quantize_``, or
            where the recipe measured them faster the library's own layers, whose activations
            are quantized in one pass, Qwen-Image's; :mod:`accel.hooks.fp8.layer_kinds`), the
            layers that cost the image most kept in bf16. The first :meth:`warmup` call
            measures every quantized layer's output against bf16 and keeps the worst ones in bf16
            until the final latents are within ``fp8_budget``, starting from those the recipe
            names (embedders, modulation, final projection); until a warm-up the weights stay
            bf16. Needs a CUDA GPU of compute capability 8.9 or newer, bf16 weights and the
            ``[fp8]`` extra (torchao); refused otherwise, in one line. Not with ``parallel``. A
            denoiser quantized when it was loaded (diffusers' ``TorchAoConfig``) is used as it
            is. One-way: :meth:`restore` leaves the quantized layers in float8 (their bf16
            weights are freed). Default None: nothing quantized, the image unchanged. See
            :mod:`accel.hooks.fp8.quantize`.
        fp8_budget: with ``quantize="fp8"``, the largest relative distance (L2 norm of the
            difference over the L2 norm of the bf16 result) of the first warm-up call's final
            latents from the same call in bf16. Default 0.05: one float8 product rounds its
            output by about 3-5% (three mantissa bits, in weights and activations alike), so a
            budget far below that keeps nearly every layer in bf16, while the peers' accepted
            float8 images (vllm-omni's gate, LPIPS 0.15, about 20 dB PSNR) are around 10% from
            bf16: 5% keeps half of that margin. A number in (0, 1].

    Several GPUs:

    Attributes:
        parallel: one image on every process of a ``torchrun`` / ``accelerate launch`` (each with
            its pipeline on its own GPU, all making the same calls with the same seed): ``"cfg"``
            (2 processes: the two guidance branches, one per GPU, bit-identical to one GPU;
            pipelines that batch their branches into one call, like Z-Image's, are refused),
            ``"ulysses"`` (diffusers' Ulysses context parallelism over all processes) or
            ``"cfg+ulysses"`` (2 x N/2 processes, N >= 4). Every rank returns the same image.
            Collective: every process must pass the same options. The process group is created
            if none exists. See :mod:`accel.parallel`. Default None: one process.
        parallel_timeout_s: how long a rank waits for the others (a dead or diverging rank)
            before it fails with an error instead of hanging; also the process group's timeout
            when ``accelerate_pipeline`` creates it. Default 300.

    Invalid values raise ValueError naming the field.
    """

    # graphs
    mode: Mode = "bcg"
    capture_on_miss: bool = False
    text_buckets: tuple[int, ...] | RecipeDefault | None = RECIPE_DEFAULT
    max_entries: int = 32
    max_segments: int = 512
    memory_budget_mb: float | None = None
    auto_breaks: bool = True
    # components
    text_encoder: bool = True
    vae: bool = True
    cfg_batch: bool = True
    # compile
    compile: bool = False
    compile_cache_dir: Path | None = None
    compiled_forms: bool = True
    inductor: tuple[tuple[str, object], ...] | None = None
    # attention
    attention: Attention | None = None
    # quantization
    quantize: Quantize | None = None
    fp8_budget: float = DEFAULT_FP8_BUDGET
    # several GPUs
    parallel: Parallel | None = None
    parallel_timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("capture_on_miss", "compile", "compiled_forms", "text_encoder", "vae", "auto_breaks", "cfg_batch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _positive_int("max_entries", self.max_entries)
        _positive_int("max_segments", self.max_segments)
        budget = self.memory_budget_mb
        if budget is not None and not (
            isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget > 0
        ):
            raise ValueError(f"memory_budget_mb must be a positive number of MiB or None, got {budget!r}")
        buckets = self.text_buckets
        if buckets is not None and buckets is not RECIPE_DEFAULT:
            if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
                raise ValueError(f"text_buckets must be a sequence of positive token counts or None, got {buckets!r}")
            for b in buckets:
                _positive_int("every text bucket", b)
            object.__setattr__(self, "text_buckets", tuple(sorted(set(buckets))))
        if self.compile_cache_dir is not None:
            object.__setattr__(self, "compile_cache_dir", Path(self.compile_cache_dir).expanduser())
        if self.inductor is not None:
            object.__setattr__(self, "inductor", _settings("inductor", self.inductor))
        if self.parallel is not None and self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be None or one of {', '.join(PARALLEL_MODES)}; got {self.parallel!r}")
        timeout = self.parallel_timeout_s
        if not (
            isinstance(timeout, (int, float))
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ValueError(f"parallel_timeout_s must be a positive number of seconds, got {timeout!r}")
        if self.attention is not None and self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be None or one of {', '.join(ATTENTION_MODES)}; got {self.attention!r}")
        if self.attention is not None and self.parallel is not None and "ulysses" in self.parallel:
            # Ulysses' all-to-alls come from diffusers' templated attention, which only its own backends take.
            raise ValueError(f"attention={self.attention!r} does not combine with parallel={self.parallel!r} yet")
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be None or one of {', '.join(QUANTIZE_MODES)}; got {self.quantize!r}")
        fp8 = self.fp8_budget
        if not (isinstance(fp8, (int, float)) and not isinstance(fp8, bool) and math.isfinite(fp8) and 0 < fp8 <= 1):
            raise ValueError(f"fp8_budget must be a relative error in (0, 1], got {fp8!r}")
        if self.quantize is not None and self.parallel is not None:
            # Each rank would measure its own share of the work and could keep other layers.
            raise ValueError(f"quantize={self.quantize!r} does not combine with parallel= yet: pass one of them")

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget_mb is None else int(self.memory_budget_mb * 2**20)


def with_overrides(options: AcceleratorOptions | None, overrides: dict[str, object]) -> AcceleratorOptions:
    """``options`` (the defaults if None) with some fields replaced; TypeError naming every
    field for a key that is none, or for ``options`` that are not :class:`AcceleratorOptions`."""
    fields = [f.name for f in dataclasses.fields(AcceleratorOptions)]
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise TypeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the options (fields of AcceleratorOptions) are {', '.join(fields)}"
        )
    if options is None:
        options = AcceleratorOptions()
    elif not isinstance(options, AcceleratorOptions):
        raise TypeError(f"options must be an AcceleratorOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options
